"""SGLang's native HTTP protocol over our runtime: /generate (SGLang's request and meta_info format),
/get_model_info (/model_info), /get_server_info (/server_info), /flush_cache, /abort_request.

Clients written for an SGLang server (its RuntimeEndpoint, `requests.post(url + "/generate", json=...)` scripts)
talk to these routes unchanged. The routes reach the engine through a *manager* with TokenizerManager's
interface: `tokenizer`, `encode(text)`, `info` (ReadyMessage), `submit(prompts, params) -> RequestStream`
(async iterator of SeqDelta, `close()` aborts), `async control(kind)`. The HTTP server passes its
TokenizerManager; `EngineManager` wraps an in-process Engine the same way (tests, `sgl.Runtime.generate`).

    app.include_router(sglang_native.make_router(lambda: state["tm"]))

/generate body (SGLang's GenerateReqInput): text (str or list) or input_ids (list or list of lists);
sampling_params (dict or one per input: max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p,
frequency_penalty, presence_penalty, repetition_penalty, stop, stop_token_ids, ignore_eos, n, regex,
json_schema, ebnf, sampling_seed; skip_special_tokens / spaces_between_special_tokens / no_stop_trim are
accepted and have no effect); return_logprob, logprob_start_len (-1: output tokens only), top_logprobs_num,
return_text_in_logprobs; stream; rid. max_new_tokens=0 computes the prompt only (prefix caching, scoring).

Response: {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop", "matched": id|null} or
{"type": "length", "length": n} or {"type": "abort", "message"}, "prompt_tokens", "completion_tokens",
"cached_tokens", "e2e_latency", and with return_logprob "input_token_logprobs", "output_token_logprobs",
"input_top_logprobs", "output_top_logprobs" as [logprob, token_id, text|null] entries}}; one such dict for a
single input with n=1, else a list (inputs in order, n per input). Streaming (a single input, n=1) sends SSE
events whose text and output_ids are cumulative, as SGLang's are, then `data: [DONE]`. Errors: 400
{"error": {"message", "type", ...}}.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.server.io_struct import ReadyMessage, SeqDelta

# SGLang sampling fields -> ours (same meaning); accepted-but-inert ones are only output-formatting switches.
_PARAM_NAMES = {
    "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n", "regex": "regex",
    "json_schema": "json_schema", "ebnf": "ebnf", "sampling_seed": "seed", "seed": "seed",
}
_INERT_PARAMS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params",
                 "stream_interval", "logit_bias"}


class GenerateBody(BaseModel):
    """SGLang's /generate request (the fields this runtime serves; others are ignored)."""
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


def sampling_params_of(fields: dict) -> SamplingParams:
    """Our SamplingParams from SGLang's sampling_params dict (ValueError naming an unknown/unsupported field)."""
    given = {}
    for key, value in fields.items():
        if key in _INERT_PARAMS or value is None:
            continue
        if key == "stop_regex":
            if value:
                raise ValueError("sampling_params.stop_regex: not supported by this runtime")
            continue
        if key not in _PARAM_NAMES:
            raise ValueError(f"sampling_params.{key}: unknown sampling parameter")
        given[_PARAM_NAMES[key]] = value
    if isinstance(given.get("json_schema"), dict):
        given["json_schema"] = json.dumps(given["json_schema"])
    return SamplingParams(**given)


class _Item:
    """One input of a request: its ids, params as the engine runs them, and what the client asked to see."""

    def __init__(self, ids: list[int], params: SamplingParams, return_logprob: bool, logprob_start_len: int,
                 top_logprobs_num: int, rid: str):
        self.ids, self.rid = ids, rid
        self.is_prompt_only = params.max_new_tokens == 0
        if self.is_prompt_only:
            params.max_new_tokens = 1  # computed and dropped: the engine always samples one token
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        if return_logprob:
            params.logprobs = True
            params.top_logprobs = top_logprobs_num
            if logprob_start_len >= 0:
                params.prompt_logprobs = True
                params.logprob_start_len = min(logprob_start_len, max(len(ids) - 1, 0))
        self.params = params


def _per_input(value, i: int, default):
    if isinstance(value, list):
        return value[i] if value[i] is not None else default
    return default if value is None else value


def parse(body: GenerateBody, encode: Callable[[str], list[int]]) -> tuple[list[_Item], bool]:
    """The request's inputs and whether it is a single one (answered with a dict rather than a list)."""
    if (body.text is None) == (body.input_ids is None):
        raise ValueError("text/input_ids: give exactly one of them")
    if body.text is not None:
        is_single = isinstance(body.text, str)
        id_lists = [encode(t) for t in ([body.text] if is_single else body.text)]
    else:
        is_single = bool(body.input_ids) and isinstance(body.input_ids[0], int)
        id_lists = [list(body.input_ids)] if is_single else [list(x) for x in body.input_ids]
    if not id_lists or any(not ids for ids in id_lists):
        raise ValueError("input_ids: empty input")
    raw = body.sampling_params
    if isinstance(raw, list) and len(raw) != len(id_lists):
        raise ValueError(f"sampling_params: {len(raw)} given for {len(id_lists)} inputs")
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(id_lists)
    items = []
    for i, ids in enumerate(id_lists):
        params = sampling_params_of(raw[i] if isinstance(raw, list) else (raw or {}))
        rid = rids[i] or uuid.uuid4().hex
        if len(id_lists) > 1 and not isinstance(body.rid, list):
            rid = f"{rid}-{i}" if body.rid else rid
        items.append(_Item(ids, params, bool(_per_input(body.return_logprob, i, False)),
                           int(_per_input(body.logprob_start_len, i, -1)),
                           int(_per_input(body.top_logprobs_num, i, 0)), rid))
    return items, is_single and items[0].params.n == 1


def _finish_reason(reason: str | None, last_id: int | None, item: _Item, eos_ids, error: str | None) -> dict:
    if reason == "length" or item.is_prompt_only:
        return {"type": "length", "length": 0 if item.is_prompt_only else item.params.max_new_tokens}
    if reason == "stop":
        stop_ids = set(item.params.stop_token_ids or ()) | (set() if item.params.ignore_eos else set(eos_ids))
        return {"type": "stop", "matched": last_id if last_id in stop_ids else None}
    return {"type": reason or "abort", "message": error}


class _Output:
    """One sequence's output, accumulated from its deltas, in SGLang's format."""

    def __init__(self, item: _Item, index: int, decode: Callable[[int], str | None], eos_ids, start: float):
        self.item, self.index, self.decode, self.eos_ids, self.start = item, index, decode, eos_ids, start
        self.text, self.output_ids = "", []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.last: SeqDelta | None = None

    def add(self, d: SeqDelta) -> None:
        if not self.item.is_prompt_only:
            self.text += d.text
            self.output_ids += d.token_ids
            self.logprobs += d.logprobs
            self.top += d.top_logprobs
        self.last = d

    def to_json(self, is_final: bool = True) -> dict:
        """The output so far; is_final: the request is over (an unfinished sequence was aborted)."""
        d, item = self.last, self.item
        meta = {"id": item.rid if item.params.n == 1 else f"{item.rid}-{self.index}",
                "prompt_tokens": len(item.ids), "completion_tokens": len(self.output_ids),
                "cached_tokens": d.cached_tokens if d else 0, "e2e_latency": time.perf_counter() - self.start}
        if d is not None and d.is_finished:
            meta["finish_reason"] = _finish_reason(d.finish_reason, self.output_ids[-1] if self.output_ids else None,
                                                   item, self.eos_ids, d.error)
        else:
            meta["finish_reason"] = {"type": "abort", "message": "aborted"} if is_final else None
        if item.return_logprob:
            entry = lambda lp, tid: [lp, tid, self.decode(tid)]  # noqa: E731
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(self.logprobs, self.output_ids)]
            meta["output_top_logprobs"] = ([[entry(lp, t) for t, lp in row] for row in self.top]
                                           if item.params.top_logprobs else [None] * len(self.output_ids))
            prompt_lps = d.prompt_logprobs if d is not None else None
            start = item.params.logprob_start_len if prompt_lps is not None else len(item.ids)
            meta["input_token_logprobs"] = [entry(prompt_lps[i], item.ids[i]) for i in range(start, len(item.ids))]
            meta["input_top_logprobs"] = [None] * len(meta["input_token_logprobs"])
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class SGLangProtocol:
    """The routes' logic over a manager (see the module docstring); `requests` maps SGLang rids to streams in
    flight, for /abort_request."""

    def __init__(self, get_manager: Callable[[], Any]):
        self.get_manager = get_manager
        self.requests: dict[str, Any] = {}

    def _decoder(self, manager, with_text: bool):
        if not with_text:
            return lambda tid: None
        return lambda tid: manager.tokenizer.decode([tid])

    def _submit(self, manager, items: list[_Item]):
        streams = []
        try:
            for item in items:
                stream = manager.submit([item.ids], item.params)
                streams.append(stream)
                self.requests[item.rid] = stream
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def generate(self, body: GenerateBody):
        manager = self.get_manager()
        items, is_single = parse(body, manager.encode)
        decode = self._decoder(manager, body.return_text_in_logprobs)
        start = time.perf_counter()
        streams = self._submit(manager, items)
        outputs = []
        try:
            for item, stream in zip(items, streams):
                outs = [_Output(item, k, decode, manager.info.eos_ids, start) for k in range(item.params.n)]
                async for d in stream:
                    outs[d.index].add(d)
                outputs += [o.to_json() for o in outs]
        finally:
            for item, s in zip(items, streams):
                s.close()
                self.requests.pop(item.rid, None)
        return outputs[0] if is_single else outputs

    async def stream_events(self, body: GenerateBody):
        """The SSE events of a streamed request (checked before the first event: ValueError)."""
        manager = self.get_manager()
        items, is_single = parse(body, manager.encode)
        if not is_single:
            raise ValueError("stream: streams a single input with n=1")
        decode = self._decoder(manager, body.return_text_in_logprobs)
        (item,) = items
        (stream,) = self._submit(manager, items)
        out = _Output(item, 0, decode, manager.info.eos_ids, time.perf_counter())

        async def events():
            try:
                async for d in stream:
                    out.add(d)
                    yield f"data: {json.dumps(out.to_json(is_final=d.is_finished))}\n\n"
            except ValueError as e:
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
            finally:
                stream.close()
                self.requests.pop(item.rid, None)
            yield "data: [DONE]\n\n"

        return events()

    def abort(self, body: AbortBody) -> None:
        rids = list(self.requests) if body.abort_all else [body.rid]
        for rid in rids:
            stream = self.requests.pop(rid, None)
            if stream is not None:
                stream.close()

    def model_info(self) -> dict:
        manager = self.get_manager()
        info: ReadyMessage = manager.info
        arch = getattr(manager, "architecture", None)
        return {"model_path": info.model_path, "tokenizer_path": info.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": None, "architectures": [arch] if arch else None,
                # ours, so our RuntimeEndpoint can use the same route
                "max_position": info.max_position, "eos_ids": list(info.eos_ids),
                "max_num_seqs": info.max_num_seqs, "enable_prefix_cache": info.enable_prefix_cache}

    async def server_info(self) -> dict:
        manager = self.get_manager()
        stats = await manager.control("stats")
        info = manager.info
        return {"model_path": info.model_path, "max_running_requests": info.max_num_seqs,
                "context_length": info.max_position, "enable_prefix_cache": info.enable_prefix_cache,
                "disable_radix_cache": not info.enable_prefix_cache, "internal_states": [stats],
                "version": "deepinfer", "frontend": "python"}

    async def flush_cache(self) -> str:
        await self.get_manager().control("flush_cache")
        return "Cache flushed.\n"


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                        status_code=status)


ROUTE_PATHS = ("/generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info", "/flush_cache",
               "/abort_request")


def make_router(get_manager: Callable[[], Any], protocol: SGLangProtocol | None = None,
                skip_paths: tuple[str, ...] = ()):
    """The APIRouter of SGLang's native routes over `get_manager()` (called per request, so it may return the
    server's TokenizerManager once the lifespan created it); `skip_paths` leaves those routes out; routers that
    share a `protocol` share its table of requests in flight (/abort_request)."""
    from fastapi import APIRouter
    from fastapi.responses import PlainTextResponse, Response, StreamingResponse

    protocol = protocol or SGLangProtocol(get_manager)
    router = APIRouter()

    def route(path: str, **kwargs):
        def add(func):
            if path not in skip_paths:
                router.add_api_route(path, func, **kwargs)
            return func
        return add

    @route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateBody):
        try:
            if body.stream:
                return StreamingResponse(await protocol.stream_events(body), media_type="text/event-stream")
            return await protocol.generate(body)
        except ValueError as e:
            return _error(400, str(e))
        except RuntimeError as e:
            return _error(500, str(e))
        except Exception as e:  # the manager's overload refusal, or another admission failure
            if type(e).__name__ == "Overloaded":
                return _error(503, str(e))
            raise

    @route("/get_model_info", methods=["GET"])
    @route("/model_info", methods=["GET"])
    async def model_info():
        return protocol.model_info()

    @route("/get_server_info", methods=["GET"])
    @route("/server_info", methods=["GET"])
    async def server_info():
        return await protocol.server_info()

    @route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return PlainTextResponse(await protocol.flush_cache())

    @route("/abort_request", methods=["POST"])
    async def abort_request(body: AbortBody):
        protocol.abort(body)
        return Response(status_code=200)

    router.protocol = protocol
    return router


def register(app, get_manager: Callable[[], Any], prefix: str = "/sglang", also_at_root: bool = True) -> SGLangProtocol:
    """Mount every route under `prefix` (an SGLang client then uses base_url + prefix) and, with also_at_root,
    at the root those whose path the app does not serve yet (so routes registered before, e.g. our native
    /generate, keep their paths; call this after them). One protocol serves both mounts."""
    protocol = SGLangProtocol(get_manager)
    if prefix:
        app.include_router(make_router(get_manager, protocol), prefix=prefix)
    if also_at_root or not prefix:
        taken = {getattr(r, "path", None) for r in app.routes}
        app.include_router(make_router(get_manager, protocol, tuple(p for p in ROUTE_PATHS if p in taken)))
    return protocol


# ---- an in-process Engine behind the same interface ----

class _EngineStream:
    def __init__(self, engine, seqs, rid: str):
        from deepinfer_rt.server.stream_deltas import TrackedRequest

        self.engine, self.seqs = engine, seqs
        self.tracked = TrackedRequest(rid, seqs)

    async def __aiter__(self):
        from deepinfer_rt.server.stream_deltas import take_deltas

        while True:
            for d in take_deltas(self.tracked):
                yield d
            if self.tracked.is_finished:
                return
            await asyncio.sleep(0.002)

    def close(self) -> None:
        if not self.tracked.is_finished:
            self.engine.abort(self.seqs)


class EngineManager:
    """TokenizerManager's interface (as these routes use it) over an in-process Engine."""

    def __init__(self, engine):
        from deepinfer_rt.models.loader import resolve_model_path

        self.engine = engine
        self.tokenizer = engine.tokenizer
        mc = engine.model_config
        self.architecture = mc.architecture
        self.info = ReadyMessage(str(resolve_model_path(engine.config.model)), mc.max_position, mc.vocab_size,
                                 tuple(engine.eos_ids), engine.config.scheduler.max_num_seqs,
                                 engine.config.cache.enable_prefix_cache)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> _EngineStream:
        (ids,) = prompts
        try:
            seqs = self.engine.add_request(ids, params)
        except ValueError:
            raise
        return _EngineStream(self.engine, seqs, uuid.uuid4().hex)

    async def control(self, kind: str) -> dict:
        if kind == "flush_cache":
            self.engine.flush_cache()
        return dict(self.engine.stats)


def generate_in_process(engine, body: GenerateBody):
    """SGLang's /generate answer computed on an in-process engine (sgl.Runtime.generate)."""
    protocol = SGLangProtocol(lambda: EngineManager(engine))
    coro = protocol.generate(body)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from async code: run on a fresh loop
        return pool.submit(asyncio.run, coro).result()
