"""The HTTP process: FastAPI routes over the TokenizerManager; the EngineSupervisor starts, watches and
restarts the scheduler process.

Routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models, /health, /metrics
(Prometheus text), native /generate, /get_server_info, /flush_cache.

No input, however malformed, earns a 5xx: bodies are bounded and walked before parsing (request_body), parsed
into strict models (api_models), checked against the model (TokenizerManager.check), and every failure is
answered in OpenAI's error shape (errors). A 5xx means the engine failed (500), is unavailable (503) or the
request ran past its timeout (504).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import shutil
import tempfile
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_rt.server import api_models, metrics, native_api, openai_api, sglang_native
from deepinfer_rt.server.api_models import ChatCompletionRequest, CompletionRequest, ErrorResponse, GenerateRequest
from deepinfer_rt.server.chat import make_chat_format
from deepinfer_rt.server.errors import (CHAT_NAMES, NATIVE_NAMES, OPENAI_NAMES, bad_request,
                                        error_response, unavailable)
from deepinfer_rt.server.request_body import GuardedRoute
from deepinfer_rt.server.supervisor import EngineSupervisor
from deepinfer_rt.server.tokenizer_manager import (EngineLost, EngineUnavailable, Overloaded, RequestTimeout,
                                                   TokenizerManager)

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
_GRACEFUL_SHUTDOWN_S = 5
"""On SIGTERM, open streams get this long to finish before they are cut."""
# pydantic names the member of a union it tried (prompt.list[constrained-int], sampling_params.
# GenerateSamplingParams); the client named only the field.
_UNION_TAG_RE = re.compile(r"^(constrained-)?(str|int|float|bool|bytes|none)$|[\[\-]|^[A-Z]")
_NAMED_MSG_RE = re.compile(r"^([a-z_][\w.]*): ")
_ERRORS = {400: "Invalid request: the field at fault is `param`", 413: "Request body too large",
           499: "Client closed the request", 500: "Internal error", 503: "Overloaded (Retry-After) or the engine "
           "is unavailable (loading, restarting, not responding)", 504: "The request ran past its timeout"}
_RESPONSES = {status: {"model": ErrorResponse, "description": why} for status, why in _ERRORS.items()}


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
    tool_call_parser: str | None = None
    """'deepseek_v3' | 'dsml' | 'none'; None: by the checkpoint (chat.make_chat_format)."""
    log_requests: bool = False
    """Log one line per finished request: id, prompts, token counts, finish reason, latency."""
    chat_encoding: str | None = None
    """'deepseek_v4' | 'deepseek_v41': render chats with deepseek-recipe; None: the tokenizer's template, or the
    renderer registered for the checkpoint's model_type when it has none."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class ClientGone(Exception):
    pass


def failure_response(e: Exception, names: dict[str, str]) -> JSONResponse:
    """The answer to what went wrong serving a request, in the one error shape."""
    if isinstance(e, Overloaded):
        return unavailable(str(e), code="overloaded")
    if isinstance(e, (EngineUnavailable, EngineLost)):
        return unavailable(str(e))
    if isinstance(e, RequestTimeout):
        return error_response(504, str(e), code="timeout")
    if isinstance(e, ClientGone):
        return error_response(499, "client closed the request")
    if isinstance(e, ValueError):
        return bad_request(e, names)
    if not isinstance(e, RuntimeError):  # RuntimeError: a generation failed in the engine, already logged there
        logger.exception("request failed", exc_info=e)
    return error_response(500, str(e) or type(e).__name__, code="internal_error")


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """400 naming the deepest field of pydantic's errors (the most specific member of a union)."""
    best, best_loc = None, None
    for err in exc.errors():
        loc = []
        for part in err.get("loc", ()):
            if isinstance(part, int):
                loc.append(f"[{part}]")
            elif part != "body" and not _UNION_TAG_RE.search(str(part)):
                loc.append(f".{part}" if loc else str(part))
        if best is None or len(loc) > len(best_loc):
            best, best_loc = err, loc
    param = "".join(best_loc) or None
    msg = str(best.get("msg", "invalid request")).removeprefix("Value error, ")
    if param is None and (named := _NAMED_MSG_RE.match(msg)):  # a check across fields names the one at fault
        param, msg = named.group(1), msg[named.end():]
    return error_response(400, f"{param}: {msg}" if param else f"request body: {msg}", param=param)


async def until_done_or_gone(request: Request, awaitable):
    """Await `awaitable`, raising ClientGone (after cancelling it) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()


async def off_loop(request: Request, fn, *args):
    """fn(*args) in a worker thread for a large body (tokenizing megabytes must not stall other requests)."""
    if getattr(request.state, "is_large_body", False):
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def create_app(args: ServerArgs, on_fatal=None) -> FastAPI:
    """on_fatal(): called once the engine is dead for good (restarts exhausted); the server should exit."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ipc = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        to_sched, from_sched = f"ipc://{ipc}/requests", f"ipc://{ipc}/outputs"
        from deepinfer_rt.models.loader import resolve_model_path

        supervisor = EngineSupervisor({"model": args.model, **args.engine_kwargs}, to_sched, from_sched)
        tm = None
        try:
            tm = TokenizerManager(str(resolve_model_path(args.model)), to_sched, from_sched,
                                  args.max_queued_requests, log_requests=args.log_requests)
            supervisor.spawn()
            await supervisor.wait_ready(tm)
            state.update(tm=tm, supervisor=supervisor, chat=make_chat_format(
                tm.tokenizer, tm.info.model_path, args.tool_call_parser, args.chat_encoding))
            watch = asyncio.create_task(supervisor.watch(tm, on_fatal or (lambda: None)))
            logger.info("serving %s (%s) on %s at http://%s:%d", args.model_name, tm.info.model_path,
                        tm.info.device or "?", args.host, args.port)
            yield
            watch.cancel()
        finally:
            if tm is not None:
                tm.shutdown()
            supervisor.stop()
            shutil.rmtree(ipc, ignore_errors=True)

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.router.route_class = GuardedRoute

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")

    def check_model(name: str) -> JSONResponse | None:
        if name not in (args.model_name, args.model, "default"):  # "default": SGLang's examples name it so
            return error_response(400, f"model: unknown model {name!r}; this server serves {args.model_name!r}",
                                  param="model", code="model_not_found")
        return None

    async def run_openai(request: Request, body, prompts, params, formatter, names, best_of=None):
        tm: TokenizerManager = state["tm"]
        stream = None
        try:
            stream = tm.submit(prompts, params)
            if not body.stream:
                return await until_done_or_gone(request, openai_api.collect(stream, formatter, best_of))
            it = stream.__aiter__()
            first = await until_done_or_gone(request, it.__anext__())
        except BaseException as e:
            if stream is not None:
                stream.close()
            if not isinstance(e, Exception):
                raise
            return failure_response(e, names)

        async def events():
            try:
                async for event in openai_api.stream_events(first, it, formatter, body.include_usage):
                    yield event
            finally:
                stream.close()  # a client that went away mid-stream: abort, free its KV

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", responses={200: {"model": api_models.CompletionResponse}, **_RESPONSES})
    async def completions(body: CompletionRequest, request: Request):
        if (error := check_model(body.model)) is not None:
            return error
        tm: TokenizerManager = state["tm"]
        try:
            prompts = await off_loop(request, openai_api.completion_inputs, body, tm.encode)
            params = openai_api.completion_params(body, max(map(len, prompts)), tm.info.max_position)
        except ValueError as e:
            return bad_request(e, OPENAI_NAMES)
        echo = None
        if body.echo:
            texts = await off_loop(request, openai_api.echo_texts, body, prompts, tm.tokenizer)
            echo = openai_api.Echo(texts, prompts, body.n, is_output_dropped=body.max_tokens == 0)
        formatter = openai_api.Formatter("text_completion", args.model_name, tm.tokenizer, echo)
        best_of = None
        if body.best_of is not None and body.best_of > body.n:
            best_of = openai_api.BestOf(body.best_of, body.n, is_logprobs_asked=body.logprobs is not None)
        return await run_openai(request, body, prompts, params, formatter, OPENAI_NAMES, best_of)

    @app.post("/v1/chat/completions", responses={200: {"model": api_models.ChatCompletionResponse}, **_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (error := check_model(body.model)) is not None:
            return error
        tm: TokenizerManager = state["tm"]
        try:
            rendered = await off_loop(request, openai_api.chat_inputs, body, state["chat"])
            params = openai_api.chat_params(body, rendered, tm.info.max_position)
        except ValueError as e:
            return bad_request(e, CHAT_NAMES)
        reading = openai_api.ChatReading.of(body, state["chat"], rendered)
        formatter = openai_api.Formatter("chat.completion", args.model_name, tm.tokenizer, reading=reading)
        return await run_openai(request, body, [rendered.ids], params, formatter, CHAT_NAMES)

    @app.post("/generate", responses={200: {"model": list[api_models.GenerateOutput]}, **_RESPONSES})
    async def generate(body: GenerateRequest, request: Request):
        tm: TokenizerManager = state["tm"]
        try:
            inputs = await off_loop(request, native_api.inputs, body, tm.encode)
            if body.stream:
                return await native_api.stream(request, tm, inputs, until_done_or_gone)
            return JSONResponse(await until_done_or_gone(request, native_api.generate(tm, inputs)))
        except Exception as e:
            return failure_response(e, NATIVE_NAMES)

    @app.get("/v1/models", responses={200: {"model": api_models.ModelList}})
    async def models():
        info = state["tm"].info
        return {"object": "list", "data": [{"id": args.model_name, "object": "model", "created": 0,
                                            "owned_by": "deepinfer", "root": info.model_path,
                                            "max_model_len": info.max_position}]}

    @app.get("/health", responses={200: {"content": {"text/plain": {}}, "description": "ok"}, 503: _RESPONSES[503]})
    async def health():
        tm: TokenizerManager | None = state.get("tm")
        supervisor: EngineSupervisor | None = state.get("supervisor")
        if tm is None or supervisor is None:
            return unavailable("engine is loading")
        reason = supervisor.fatal or tm.unavailable_reason
        if reason is None and not supervisor.proc.is_alive():
            reason = "engine process is not running"
        return unavailable(reason) if reason is not None else PlainTextResponse("ok")

    @app.get("/get_server_info", responses={503: _RESPONSES[503]})
    async def server_info():
        try:
            return await _server_info(state["tm"], args)
        except EngineUnavailable as e:
            return unavailable(str(e))

    @app.post("/flush_cache", responses={503: _RESPONSES[503]})
    async def flush_cache():
        try:
            return await state["tm"].control("flush_cache")
        except EngineUnavailable as e:
            return unavailable(str(e))

    @app.get("/metrics", responses={200: {"content": {"text/plain": {}}}, 503: _RESPONSES[503]})
    async def prometheus_metrics():
        try:
            text = state["tm"].metrics.render(await _server_info(state["tm"], args))
        except EngineUnavailable as e:
            return unavailable(str(e))
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    # SGLang's native protocol: under /sglang (an SGLang RuntimeEndpoint takes base_url + "/sglang"), and at the
    # root for the paths the routes above do not serve.
    sglang_native.register(app, lambda: state["tm"])

    def openapi() -> dict:
        """FastAPI's schema with the codes the server really sends: 400 for a body that does not validate
        (FastAPI would document 422, which this server never answers)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _server_info(tm: TokenizerManager, args: ServerArgs) -> dict:
    stats = await tm.control("stats")
    return {"model": args.model_name, **dataclasses.asdict(tm.info), "scheduler_pid": tm.scheduler_pid,
            "num_inflight_seqs": tm.num_inflight_seqs, "num_engine_restarts": tm.num_engine_restarts,
            "max_inflight_seqs": tm.max_inflight_seqs, "num_rejected_overload": tm.num_rejected_overload, **stats}


def launch_server(args: ServerArgs) -> None:
    """Serve until SIGTERM/SIGINT; SystemExit(1) if the engine died for good (restarts exhausted)."""
    import uvicorn

    if not logging.getLogger().handlers:  # the startup line and the request log go to stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server, fatal = None, []

    def on_fatal() -> None:
        fatal.append(True)
        server.should_exit = True

    app = create_app(args, on_fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_keep_alive=30, timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
    server.run()
    if fatal:
        raise SystemExit(1)
