"""One error shape for every answer that is not a success, OpenAI's:
`{"error": {"message", "type", "param", "code"}}` (api_models.ErrorResponse), with the field at fault named as
the client knows it (max_tokens, not SamplingParams.max_new_tokens)."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from deepinfer_rt.sampling_params import SamplingParams

RETRY_AFTER_S = 1

# Messages raised below the HTTP layer start with the field they blame: "SamplingParams.top_k: ...",
# "input_ids[2]: ...", "regex: ...".
_FIELD_RE = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_]\w*)((?:\[\d+\])?)(?=[/:.])")
_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__ if f != "stop_strings"}

OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format",
                "input_ids": "prompt", "prompts": "prompt"}
"""Engine names -> the OpenAI API's (completions; chat adds input_ids -> messages)."""
CHAT_NAMES = {**OPENAI_NAMES, "input_ids": "messages"}
NATIVE_NAMES = {f: f"sampling_params.{f}" for f in _SAMPLING_FIELDS}
"""/generate: SamplingParams fields live under sampling_params."""


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def unavailable(message: str, code: str = "engine_unavailable") -> JSONResponse:
    return error_response(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def bad_request(e: Exception, names: dict[str, str]) -> JSONResponse:
    """400 for a ValueError whose message starts with the field it blames, renamed by `names`."""
    message = str(e)
    match = _FIELD_RE.match(message)
    param = None
    if match:
        field, index = match.group(1), match.group(2)
        param = names.get(field, field)
        message = param + index + message[match.end():]
    return error_response(400, message, param=param)
