"""`deepinfer batch INPUT.jsonl OUTPUT.jsonl`: OpenAI batch files run offline on one engine.

Input lines: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`.
Output lines (OpenAI's batch output): `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`; the body is what the server would answer (the server's request models, translation and response
formatting are used as they are). A line that cannot run gets its own error line (status 400 and the error
body, or `response: null` when the line is not a request at all); the others run. Every runnable request is
submitted before the first is awaited, so they share batches. Results are appended as they finish, so a run cut
short resumes: custom_ids already in OUTPUT (and lines already reported unreadable) are skipped.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from deepinfer_rt.request import GenerateOutput, Req
from deepinfer_rt.server import openai_api
from deepinfer_rt.server.api_models import ChatCompletionRequest, CompletionRequest
from deepinfer_rt.server.chat import make_chat_format
from deepinfer_rt.server.errors import CHAT_NAMES, OPENAI_NAMES, error_response
from deepinfer_rt.server.http_server import failure_response, validation_response
from deepinfer_rt.server.io_struct import SeqDelta

ENDPOINTS = {"/v1/completions": (CompletionRequest, "text_completion", OPENAI_NAMES),
             "/v1/chat/completions": (ChatCompletionRequest, "chat.completion", CHAT_NAMES)}
_LINE_KEYS = {"custom_id", "method", "url", "body"}
_POLL_S = 0.5


class LineError(Exception):
    """A line that is not a batch request (no response body): its message is the line's error."""

    def __init__(self, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.custom_id = custom_id


@dataclass
class Job:
    line: int
    custom_id: str
    kind: str = ""
    model: str = ""
    groups: list[list[Req]] = field(default_factory=list)
    """One group per prompt: its params.n sequences."""
    formatter_kwargs: dict = field(default_factory=dict)
    """echo (completions) or reading (chat), as the server builds them."""
    best_of: object = None

    @property
    def is_finished(self) -> bool:
        return all(r.is_finished for g in self.groups for r in g)


def _line_id(line: int) -> str:
    return f"batch_req_line{line}"


def read_done(output: Path) -> set[str]:
    """custom_ids (and ids of unreadable lines) already in OUTPUT. A last line cut off mid-write (a run killed
    while writing) is removed, so the file stays valid JSONL."""
    if not output.exists():
        return set()
    raw = output.read_bytes()
    good_end = raw.rfind(b"\n") + 1
    done = set()
    for text in raw[:good_end].decode("utf-8").splitlines():
        if text.strip():
            record = json.loads(text)
            done.add(record["custom_id"] if record.get("custom_id") is not None else record["id"])
    tail = raw[good_end:]
    if tail.strip():
        try:
            record = json.loads(tail)
            done.add(record["custom_id"] if record.get("custom_id") is not None else record["id"])
            good_end = len(raw)  # complete, only its newline missing
        except ValueError:
            pass
    if good_end < len(raw):
        with output.open("r+b") as f:
            f.truncate(good_end)
    elif raw and not raw.endswith(b"\n"):
        with output.open("ab") as f:
            f.write(b"\n")
    return done


def parse_line(text: str, line: int) -> tuple[str, str, dict]:
    """(custom_id, url, body) of an input line, or LineError saying what is wrong with it."""
    try:
        record = json.loads(text)
    except ValueError as e:
        raise LineError(f"line {line}: not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise LineError(f"line {line}: expected a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"line {line}: custom_id: required, a non-empty string")
    unknown = sorted(set(record) - _LINE_KEYS)
    if unknown:
        raise LineError(f"line {line}: unknown fields {unknown}; a line has {sorted(_LINE_KEYS)}", custom_id)
    if record.get("method") != "POST":
        raise LineError(f"line {line}: method: must be 'POST'", custom_id)
    if record.get("url") not in ENDPOINTS:
        raise LineError(f"line {line}: url: must be one of {sorted(ENDPOINTS)}, got {record.get('url')!r}", custom_id)
    if not isinstance(record.get("body"), dict):
        raise LineError(f"line {line}: body: required, a JSON object", custom_id)
    return custom_id, record["url"], record["body"]


class BatchRunner:
    def __init__(self, engine, model_names: set[str]):
        from deepinfer_rt.models.loader import resolve_model_path

        self.engine = engine
        self.model_names = model_names
        self.max_position = engine.model_config.max_position
        self.chat = make_chat_format(engine.tokenizer, resolve_model_path(engine.config.model))
        self.names: dict[str, dict] = {}

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=True)

    def submit(self, job: Job, url: str, body: dict) -> None:
        """Validate and queue one request; ValueError / ValidationError / _Refused refuse it."""
        model_cls, job.kind, names = ENDPOINTS[url]
        self.names[job.custom_id] = names
        req = model_cls.model_validate(body)
        job.model = req.model
        if req.model not in self.model_names:
            raise _Refused(error_response(400, f"model: unknown model {req.model!r}; this batch runs "
                                          f"{sorted(self.model_names)}", param="model", code="model_not_found"))
        if req.stream:
            raise _Refused(error_response(400, "stream: a batch request is not streamed", param="stream"))
        if url == "/v1/completions":
            prompts = openai_api.completion_inputs(req, self._encode)
            params = openai_api.completion_params(req, max(map(len, prompts)), self.max_position)
            if req.echo:
                texts = openai_api.echo_texts(req, prompts, self.engine.tokenizer)
                job.formatter_kwargs["echo"] = openai_api.Echo(texts, prompts, req.n,
                                                               is_output_dropped=req.max_tokens == 0)
            if req.best_of is not None and req.best_of > req.n:
                job.best_of = openai_api.BestOf(req.best_of, req.n, is_logprobs_asked=req.logprobs is not None)
        else:
            rendered = openai_api.chat_inputs(req, self.chat)
            params = openai_api.chat_params(req, rendered, self.max_position)
            prompts = [rendered.ids]
            job.formatter_kwargs["reading"] = openai_api.ChatReading.of(req, self.chat, rendered)
        groups = []
        try:  # add_request validates as generate does; a bad prompt withdraws those queued before it
            for ids in prompts:
                groups.append(self.engine.add_request(ids, params))
        except ValueError:
            self.engine.abort([r for g in groups for r in g])
            raise
        job.groups = groups

    async def response(self, job: Job) -> tuple[int, dict]:
        """(status, body) of a finished job, formatted by the server's code."""
        formatter = openai_api.Formatter(job.kind, job.model, self.engine.tokenizer, **job.formatter_kwargs)
        n = len(job.groups[0])

        async def deltas():
            for i, group in enumerate(job.groups):
                for k, req in enumerate(group):
                    out = GenerateOutput.from_req(req)
                    yield SeqDelta(f"{job.custom_id}-{i}", i * n + k, out.token_ids, out.text,
                                   out.logprobs or [], out.top_logprobs or [], out.finish_reason, out.error,
                                   prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                                   cached_tokens=out.cached_tokens, prompt_logprobs=out.prompt_logprobs,
                                   prompt_top_logprobs=out.prompt_top_logprobs)

        try:
            return 200, await openai_api.collect(deltas(), formatter, job.best_of)
        except Exception as e:  # noqa: BLE001 -- a failed generation (finish_reason 'error') fails its line
            return _error_body(failure_response(e, self.names[job.custom_id]))


class _Refused(Exception):
    def __init__(self, response):
        super().__init__(response)
        self.response = response


def _error_body(response) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)


def _record(custom_id: str | None, line: int, status: int | None, body: dict | None, request_id: str | None = None,
            error: str | None = None) -> dict:
    """One output line in OpenAI's batch output format."""
    if status is not None and status != 200 and error is None:
        error = body["error"]["message"]
    return {"id": _line_id(line) if custom_id is None else f"batch_req_{request_id or line}",
            "custom_id": custom_id,
            "response": None if status is None else {"status_code": status, "request_id": request_id,
                                                     "body": body},
            "error": None if error is None else {"code": "invalid_request" if (status or 400) < 500
                                                 else "server_error", "message": error}}


def run_batch(engine, input_path: str | Path, output_path: str | Path, model_names: set[str],
              progress: bool = True) -> dict:
    """Run the requests of INPUT not yet in OUTPUT on `engine`, appending results to OUTPUT. Returns counts."""
    return asyncio.run(_run(engine, Path(input_path), Path(output_path), model_names, progress))


async def _run(engine, input_path: Path, output_path: Path, model_names: set[str], progress: bool) -> dict:
    from tqdm import tqdm

    runner = BatchRunner(engine, model_names)
    done = read_done(output_path)
    seen: set[str] = set()
    counts = {"skipped": 0, "succeeded": 0, "failed": 0}
    t0 = time.perf_counter()
    pending: list[Job] = []
    with open(input_path, encoding="utf-8") as src, open(output_path, "a", encoding="utf-8") as out:
        def write(record: dict) -> None:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            ok = record["response"] is not None and record["response"]["status_code"] == 200
            counts["succeeded" if ok else "failed"] += 1

        for line, text in enumerate(src, 1):
            if not text.strip():
                continue
            try:
                custom_id, url, body = parse_line(text, line)
            except LineError as e:
                if (e.custom_id or _line_id(line)) in done:
                    counts["skipped"] += 1
                elif e.custom_id is not None and e.custom_id in seen:
                    write(_record(e.custom_id, line, None, None, error=f"{e} (and custom_id {e.custom_id!r} "
                                  "appears twice in the input)"))
                else:
                    seen.add(e.custom_id)
                    write(_record(e.custom_id, line, None, None, error=str(e)))
                continue
            if custom_id in done:
                counts["skipped"] += 1
                continue
            if custom_id in seen:
                write(_record(custom_id, line, *_error_body(error_response(
                    400, f"custom_id: {custom_id!r} appears twice in the input (line {line})", param="custom_id"))))
                continue
            seen.add(custom_id)
            job = Job(line, custom_id)
            try:
                runner.submit(job, url, body)
            except _Refused as e:
                write(_record(custom_id, line, *_error_body(e.response)))
            except ValidationError as e:
                write(_record(custom_id, line, *_error_body(validation_response(RequestValidationError(e.errors())))))
            except ValueError as e:
                write(_record(custom_id, line, *_error_body(failure_response(e, runner.names[custom_id]))))
            else:
                pending.append(job)
        bar = tqdm(total=len(pending), desc="batch", unit="req", disable=not progress)
        num_steps = engine.num_steps
        while pending:
            num_steps = await asyncio.to_thread(engine.wait_for_step, num_steps, _POLL_S)
            finished = [job for job in pending if job.is_finished]
            if not finished:
                if engine.loop_error is not None:
                    raise RuntimeError(f"engine failed: {engine.loop_error}")
                continue
            pending = [job for job in pending if not job.is_finished]
            for job in finished:
                status, body = await runner.response(job)
                write(_record(job.custom_id, job.line, status, body, request_id=body.get("id")))
            bar.update(len(finished))
        bar.close()
    counts["seconds"] = round(time.perf_counter() - t0, 3)
    return counts


def run_batch_file(input_path: str, output_path: str, engine_kwargs: dict, model_names: set[str],
                   progress: bool = True) -> dict:
    """`deepinfer batch`: build the engine, run the file, shut down."""
    from deepinfer_rt.engine import Engine

    with Engine(**engine_kwargs) as engine:
        return run_batch(engine, input_path, output_path, model_names, progress)
