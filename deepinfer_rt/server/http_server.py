"""The HTTP process: FastAPI routes over the TokenizerManager; starts and stops the scheduler process.

Routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models, /health, /metrics
(Prometheus text), native /generate, /get_server_info, /flush_cache.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from deepinfer_rt.server import metrics, native_api, openai_api
from deepinfer_rt.server.chat import make_chat_renderer
from deepinfer_rt.server.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from deepinfer_rt.server.scheduler_process import run_scheduler_process
from deepinfer_rt.server.tokenizer_manager import Overloaded, TokenizerManager

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0
_DISCONNECT_POLL_S = 0.5
_RETRY_AFTER_S = 1
_GRACEFUL_SHUTDOWN_S = 5
"""On SIGTERM, open streams get this long to finish before they are cut."""
# pydantic names the member of a union it tried (prompt.list[int]); the client named only the field.
_UNION_MEMBER_RE = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")
# Engine messages name SamplingParams fields; a client of the OpenAI API knows them by these names.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format",
                "input_ids": "prompt", "prompts": "prompt"}
_FIELD_RE = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][\w.]*)(?:\[\d+\])?[/:]")


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    max_queued_requests: int = 256
    """Sequences admitted beyond max_num_seqs; more are refused with 503 and Retry-After."""
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    """Engine arguments besides model (dtype, device, kv_cache_tokens, max_num_seqs, ...)."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class ClientGone(Exception):
    pass


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def bad_request(e: Exception) -> JSONResponse:
    message = str(e)
    match = _FIELD_RE.match(message)
    param = _PARAM_NAMES.get(match.group(1), match.group(1)) if match else None
    return error_response(400, message, param=param)


async def until_done_or_gone(request: Request, awaitable):
    """Await `awaitable`, raising ClientGone (after cancelling it) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ClientGone


def create_app(args: ServerArgs) -> FastAPI:
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ipc = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        to_sched, from_sched = f"ipc://{ipc}/requests", f"ipc://{ipc}/outputs"
        proc = multiprocessing.get_context("spawn").Process(
            target=run_scheduler_process, daemon=True,
            args=({"model": args.model, **args.engine_kwargs}, to_sched, from_sched, os.getpid()))
        tm = None
        try:
            proc.start()
            tm = state["tm"] = await _start_manager(args, to_sched, from_sched, proc)
            state["proc"] = proc
            state["chat"] = make_chat_renderer(tm.tokenizer, tm.info.model_path)
            watchdog = asyncio.create_task(_watch_scheduler(tm, proc))
            logger.info("serving %s on http://%s:%d", args.model_name, args.host, args.port)
            yield
            watchdog.cancel()
        finally:
            if tm is not None:
                tm.shutdown()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            shutil.rmtree(ipc, ignore_errors=True)

    app = FastAPI(title="deepinfer", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_MEMBER_RE.match(str(p))]
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('msg')}", code="json_invalid")
        param = ".".join(loc) or None
        return error_response(400, f"{param}: {err.get('msg')}" if param else err.get("msg", "invalid request"),
                              param=param)

    def check_model(name: str) -> JSONResponse | None:
        if name not in (args.model_name, args.model):
            return error_response(400, f"model: unknown model {name!r}; this server serves {args.model_name!r}",
                                  param="model", code="model_not_found")
        return None

    async def run_openai(request: Request, body, prompts, params, formatter):
        tm: TokenizerManager = state["tm"]
        try:
            stream = tm.submit(prompts, params)
        except Overloaded as e:
            return error_response(503, str(e), code="overloaded", headers={"Retry-After": str(_RETRY_AFTER_S)})
        try:
            if not body.stream:
                return await until_done_or_gone(request, openai_api.collect(stream, formatter))
            it = stream.__aiter__()
            first = await until_done_or_gone(request, it.__anext__())
        except ClientGone:
            stream.close()
            return error_response(499, "client closed the request")
        except ValueError as e:
            stream.close()
            return bad_request(e)
        except RuntimeError as e:
            stream.close()
            return error_response(500, str(e))

        async def events():
            try:
                async for event in openai_api.stream_events(first, it, formatter, body.include_usage):
                    yield event
            finally:
                stream.close()  # a client that went away mid-stream: abort, free its KV

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (error := check_model(body.model)) is not None:
            return error
        tm: TokenizerManager = state["tm"]
        try:
            prompts = openai_api.completion_inputs(body, tm.encode)
            params = openai_api.completion_params(body)
        except ValueError as e:
            return bad_request(e)
        formatter = openai_api.Formatter("text_completion", body.model, tm.tokenizer)
        return await run_openai(request, body, prompts, params, formatter)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (error := check_model(body.model)) is not None:
            return error
        tm: TokenizerManager = state["tm"]
        try:
            prompts = openai_api.chat_inputs(body, state["chat"])
            params = openai_api.chat_params(body, len(prompts[0]), tm.info.max_position)
        except ValueError as e:
            return bad_request(e)
        formatter = openai_api.Formatter("chat.completion", body.model, tm.tokenizer)
        return await run_openai(request, body, prompts, params, formatter)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        tm: TokenizerManager = state["tm"]
        try:
            inputs = native_api.inputs(body, tm.encode)
        except ValueError as e:
            return bad_request(e)
        try:
            if body.stream:
                return await native_api.stream(request, tm, inputs, until_done_or_gone)
            return JSONResponse(await until_done_or_gone(request, native_api.generate(tm, inputs)))
        except Overloaded as e:
            return error_response(503, str(e), code="overloaded", headers={"Retry-After": str(_RETRY_AFTER_S)})
        except ClientGone:
            return error_response(499, "client closed the request")
        except ValueError as e:
            return bad_request(e)

    @app.get("/v1/models")
    async def models():
        info = state["tm"].info
        return {"object": "list", "data": [{"id": args.model_name, "object": "model", "created": 0,
                                            "owned_by": "deepinfer", "root": info.model_path,
                                            "max_model_len": info.max_position}]}

    @app.get("/health")
    async def health():
        proc = state.get("proc")
        if proc is None or not proc.is_alive():
            return error_response(503, "scheduler process is not running")
        return PlainTextResponse("ok")

    @app.get("/get_server_info")
    async def server_info():
        return await _server_info(state["tm"], args)

    @app.post("/flush_cache")
    async def flush_cache():
        return await state["tm"].control("flush_cache")

    @app.get("/metrics")
    async def prometheus_metrics():
        text = metrics.render(await _server_info(state["tm"], args))
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    return app


async def _start_manager(args: ServerArgs, to_sched: str, from_sched: str, proc) -> TokenizerManager:
    from deepinfer_rt.models.loader import resolve_model_path

    tm = TokenizerManager(str(resolve_model_path(args.model)), to_sched, from_sched, args.max_queued_requests)
    ready = asyncio.ensure_future(tm.wait_ready(_READY_TIMEOUT_S))
    while not ready.done():  # a scheduler process that dies while loading must not leave us waiting
        await asyncio.wait({ready}, timeout=1.0)
        if not ready.done() and not proc.is_alive():
            ready.cancel()
            tm.shutdown()
            raise RuntimeError(f"scheduler process exited with code {proc.exitcode} while loading the model")
    ready.result()
    tm.scheduler_pid = proc.pid
    return tm


async def _watch_scheduler(tm: TokenizerManager, proc) -> None:
    while proc.is_alive():
        await asyncio.sleep(1.0)
    logger.error("scheduler process exited with code %s", proc.exitcode)
    while True:  # requests sent after this fail too
        tm.fail_all(f"scheduler process exited with code {proc.exitcode}")
        await asyncio.sleep(1.0)


async def _server_info(tm: TokenizerManager, args: ServerArgs) -> dict:
    stats = await tm.control("stats")
    return {"model": args.model_name, **dataclasses.asdict(tm.info), "scheduler_pid": tm.scheduler_pid,
            "num_inflight_seqs": tm.num_inflight_seqs,
            "max_inflight_seqs": tm.max_inflight_seqs, "num_rejected_overload": tm.num_rejected_overload, **stats}


def launch_server(args: ServerArgs) -> None:
    import uvicorn

    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30,
                timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
