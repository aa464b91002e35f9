"""RuntimeEndpoint: the interpreter's backend over a running `deepinfer serve` (native /generate over HTTP).

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))

Token ids travel both ways, so prompts and prefix-cache reuse are exactly those of the in-process backend; the
tokenizer is loaded from the model folder the server reports (the server runs on this machine or shares it).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Iterator

from deepinfer_lang.backend import RuntimeBackend
from deepinfer_rt import GenerateOutput, SamplingParams
from deepinfer_rt.models.loader import load_model_config
from deepinfer_rt.tokenizer import load_tokenizer

_TIMEOUT_S = 600.0


def _params_body(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def _output(item: dict) -> GenerateOutput:
    meta = item["meta_info"]
    top = meta.get("top_logprobs")
    return GenerateOutput(
        text=item["text"], token_ids=item["output_ids"], finish_reason=meta["finish_reason"], error=meta["error"],
        prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
        cached_tokens=meta["cached_tokens"], logprobs=meta.get("logprobs"),
        top_logprobs=[[tuple(pair) for pair in row] for row in top] if top is not None else None,
        prompt_logprobs=meta.get("prompt_logprobs"))


class HttpEngine:
    """The part of Engine's API that RuntimeBackend uses (same keyword names), answered by a server."""

    def __init__(self, base_url: str, api_key: str | None = None, verify=None):
        import httpx  # the server extra's client; the in-process backend does not need it

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.Client(base_url=self.base_url, timeout=_TIMEOUT_S, headers=headers,
                                   verify=True if verify is None else verify)
        self.info = self._check(self.client.get("/get_server_info")).json()
        self.tokenizer = load_tokenizer(self.info["model_path"])
        self.model_config, _ = load_model_config(self.info["model_path"])  # picks the chat renderer
        self.eos_ids = tuple(self.info["eos_ids"])

    @staticmethod
    def _check(response):
        if response.status_code == 400:
            raise ValueError(response.json()["error"]["message"])
        response.raise_for_status()
        return response

    def generate(self, input_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams]
                 ) -> list[GenerateOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        body = {"input_ids": input_ids, "sampling_params": [_params_body(p) for p in params]}
        return [_output(item) for item in self._check(self.client.post("/generate", json=body)).json()]

    def stream(self, input_ids: list[int], sampling_params: SamplingParams) -> Iterator[str]:
        body = {"input_ids": input_ids, "sampling_params": _params_body(sampling_params), "stream": True}
        with self.client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                response.read()
                self._check(response)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event["text"]:
                    yield event["text"]

    def flush_cache(self) -> None:
        self._check(self.client.post("/flush_cache"))

    def close(self) -> None:
        self.client.close()


class RuntimeEndpoint(RuntimeBackend):
    """SGLang's RuntimeEndpoint(base_url, api_key, verify, chat_template_name) over `deepinfer serve`."""

    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None, verify=None,
                 chat_template_name: str | None = None):
        super().__init__(HttpEngine(base_url, api_key, verify), chat_template_name)
        self.base_url = self.engine.base_url

    def get_model_name(self) -> str:
        return self.engine.info["model_path"]

    def get_server_info(self) -> dict:
        return self.engine._check(self.engine.client.get("/get_server_info")).json()

    @property
    def is_prefix_cache_enabled(self) -> bool:
        return self.engine.info["enable_prefix_cache"]

    @property
    def max_running_requests(self) -> int:
        return self.engine.info["max_num_seqs"]

    def shutdown(self) -> None:
        self.engine.close()
