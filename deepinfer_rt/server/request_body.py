"""Request bodies read within limits, before the routes' pydantic models see them.

The size limit is checked against Content-Length before anything is read, and again while reading (a body
without Content-Length, or one that lies). A large body is parsed in a worker thread so the event loop keeps
serving; the parsed value is walked once (iteratively) for nesting depth and text that is not valid UTF-8, so no
later stage (pydantic, json.dumps, pickle, the grammar compiler) meets a structure deep enough to recurse out
of the stack or a lone surrogate.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.routing import APIRoute

from deepinfer_rt.env import get_env
from deepinfer_rt.sampling_params import find_json_problem
from deepinfer_rt.server.errors import error_response


def _parse(body: bytes, max_depth: int):
    """(value, None) or (None, (status, message, param, code))."""
    try:
        value = json.loads(body)
    except RecursionError:
        return None, (400, f"malformed JSON body: nested deeper than {max_depth} levels", None, "json_too_deep")
    except UnicodeDecodeError:
        return None, (400, "malformed JSON body: not valid UTF-8", None, "json_invalid")
    except ValueError as e:
        return None, (400, f"malformed JSON body: {e}", None, "json_invalid")
    problem = find_json_problem(value, max_depth)
    if problem is not None:
        path, why = problem
        param = path.lstrip(".") or None
        return None, (400, f"{param or 'body'}: {why}", param, "json_too_deep" if "deeper" in why else None)
    return value, None


async def read_json_body(request: Request):
    """None when the body is ready for the route (cached on the request), else the error response."""
    env = get_env()
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            return error_response(400, "invalid Content-Length header")
        if int(length) > env.max_body_bytes:
            return _too_large(env.max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > env.max_body_bytes:
            return _too_large(env.max_body_bytes)
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # starlette's cache: FastAPI reads it from here
    if not body:
        return None
    if len(body) > env.json_offload_bytes:
        value, problem = await asyncio.to_thread(_parse, body, env.max_json_depth)
    else:
        value, problem = _parse(body, env.max_json_depth)
    if problem is not None:
        status, message, param, code = problem
        return error_response(status, message, param=param, code=code)
    request._json = value
    request.state.is_large_body = len(body) > env.json_offload_bytes
    return None


def _too_large(limit: int):
    return error_response(413, f"request body larger than {limit} bytes (DEEPINFER_MAX_BODY_BYTES)",
                          code="body_too_large")


class GuardedRoute(APIRoute):
    """An APIRoute whose POST bodies go through read_json_body first."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            if request.method == "POST":
                error = await read_json_body(request)
                if error is not None:
                    return error
            return await handler(request)

        return guarded
