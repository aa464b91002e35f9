"""The HTTP process's side of the runtime: tokenizes, admits (queue limit), sends requests to the scheduler
process over pyzmq and routes the deltas coming back to the request that waits for them.

Admission is transactional: `submit` counts a request's sequences only once every check passed and every
message left, and a request that fails on the way (a rejection, an error packing it, a timeout, its client
gone, the engine process dead) gives back all it counted when its stream closes. So `num_inflight_seqs` returns
to zero whenever the server is idle.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import AsyncIterator

import zmq
import zmq.asyncio

from deepinfer_rt.env import get_env
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.server.metrics import ServerMetrics
from deepinfer_rt.server.io_struct import (AbortReq, ControlOutput, ControlReq, GenerateReqInput, Heartbeat,
                                           ReadyMessage, SeqDelta, ShutdownReq)
from deepinfer_rt.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """More sequences in flight than the queue limit allows; the client should retry later."""


class EngineUnavailable(Exception):
    """The engine process is loading, restarting, dead or not responding: 503, retry later."""


class EngineLost(RuntimeError):
    """The engine process died under an open request."""


class RequestTimeout(RuntimeError):
    """The request ran past DEEPINFER_REQUEST_TIMEOUT; it was aborted."""


class RequestStream:
    """The sequences of one HTTP request (one engine request per prompt, each with params.n sequences), their
    deltas merged in arrival order with indexes prompt_index * n + k."""

    def __init__(self, manager: "TokenizerManager", rids: list[str], n: int, timeout_s: float):
        self.manager = manager
        self.queue: asyncio.Queue[SeqDelta | Exception] = asyncio.Queue()
        self.num_open = len(rids) * n
        self._index_offsets = {rid: i * n for i, rid in enumerate(rids)}
        self.open_rids = set(rids)
        self._num_open_per_rid = {rid: n for rid in rids}
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s if timeout_s > 0 else None
        self._last_token_at: dict[int, float] = {}
        self._usage: dict[str, tuple[int, int]] = {}
        """rid -> (prompt tokens, cached tokens), for the counters and the request log."""
        self._num_completion_tokens = 0
        self._finish_reasons: set[str] = set()

    def put(self, delta: SeqDelta) -> None:
        delta.index += self._index_offsets[delta.rid]
        self.queue.put_nowait(delta)

    def fail(self, message: str) -> None:
        self.queue.put_nowait(EngineLost(message))

    async def _next(self) -> SeqDelta | Exception:
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return RequestTimeout(f"request timed out after {self.manager.env.request_timeout_s:g} s "
                                  "(DEEPINFER_REQUEST_TIMEOUT)")

    async def __aiter__(self) -> AsyncIterator[SeqDelta]:
        """Deltas until every sequence finished; a rejected prompt raises ValueError (its message), a failed
        scheduler process EngineLost, a request past its deadline RequestTimeout."""
        while self.num_open:
            delta = await self._next()
            if isinstance(delta, Exception):
                self.close()
                raise delta
            if delta.is_rejected:
                self.close()
                raise ValueError(delta.error)
            if delta.is_finished:
                self._finish_seq(delta.rid)
            self._measure(delta)
            yield delta
        self._log()

    def _measure(self, d: SeqDelta) -> None:
        """TTFT, inter-token latency (per token of a delta), end-to-end latency, prompt token counters."""
        metrics, now = self.manager.metrics, time.monotonic()
        if d.token_ids:
            last = self._last_token_at.get(d.index)
            if last is None:
                metrics.ttft.observe(now - self.start)
                for _ in d.token_ids[1:]:
                    metrics.itl.observe(0.0)  # tokens that came with the first one
            else:
                for _ in d.token_ids:
                    metrics.itl.observe((now - last) / len(d.token_ids))
            self._last_token_at[d.index] = now
        if d.is_finished:
            metrics.e2e.observe(now - self.start)
            self._num_completion_tokens += d.completion_tokens
            self._finish_reasons.add(d.finish_reason)
            if d.rid not in self._usage:
                self._usage[d.rid] = (d.prompt_tokens, d.cached_tokens)
                metrics.prompt_tokens.inc(d.prompt_tokens)
                metrics.cached_tokens.inc(d.cached_tokens)

    def _log(self) -> None:
        if self.manager.log_requests:
            logger.info("request %s: %d prompt(s), %d prompt tokens (%d cached), %d completion tokens, "
                        "finish %s, %.3f s", next(iter(self._index_offsets)).rsplit("-", 1)[0], len(self._usage),
                        sum(p for p, _ in self._usage.values()), sum(c for _, c in self._usage.values()),
                        self._num_completion_tokens, "/".join(sorted(self._finish_reasons)),
                        time.monotonic() - self.start)

    def _finish_seq(self, rid: str, count: int = 1) -> None:
        self.num_open -= count
        self.manager.num_inflight_seqs -= count
        self._num_open_per_rid[rid] -= count
        if not self._num_open_per_rid[rid]:
            self.open_rids.discard(rid)
            self.manager.streams.pop(rid, None)

    def close(self) -> None:
        """Abort whatever has not finished (client gone, a sibling prompt was rejected, an error); frees its KV
        and its admission. Idempotent."""
        for rid in list(self.open_rids):
            self.manager.send(AbortReq(rid))
            self._finish_seq(rid, self._num_open_per_rid[rid])
        self.num_open = 0


class TokenizerManager:
    def __init__(self, model_path: str, to_scheduler_addr: str, from_scheduler_addr: str, max_queued_seqs: int,
                 log_requests: bool = False):
        self.env = get_env()
        self.metrics = ServerMetrics()
        self.log_requests = log_requests
        """Log one line per finished request (its id, token counts, finish reason, latency)."""
        self.tokenizer = load_tokenizer(model_path)
        self.max_queued_seqs = max_queued_seqs
        self.max_inflight_seqs = 0  # the queue limit, once ready: the engine's max_num_seqs + max_queued_seqs
        self.num_inflight_seqs = 0
        self.num_rejected_overload = 0
        self.num_engine_restarts = 0
        self.streams: dict[str, RequestStream] = {}
        self.info: ReadyMessage | None = None
        self.scheduler_pid: int | None = None
        self.is_ready = False
        self.down_reason = "engine is loading"
        """Why requests are refused while not is_ready."""
        self.last_heartbeat = 0.0
        self._ready: asyncio.Future | None = None
        self._controls: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._ctx = zmq.asyncio.Context()
        self._to_scheduler = self._ctx.socket(zmq.PUSH)
        self._to_scheduler.bind(to_scheduler_addr)
        self._from_scheduler = self._ctx.socket(zmq.PULL)
        self._from_scheduler.bind(from_scheduler_addr)
        self._recv_task: asyncio.Task | None = None

    async def wait_ready(self, timeout_s: float) -> ReadyMessage:
        """Until the (re)started scheduler process announces its engine; its startup error is raised."""
        self._ready = asyncio.get_running_loop().create_future()
        if self._recv_task is None:
            self._recv_task = asyncio.create_task(self._recv_loop())
        msg = await asyncio.wait_for(self._ready, timeout_s)
        self.info = msg
        self.max_inflight_seqs = msg.max_num_seqs + self.max_queued_seqs
        self.last_heartbeat = time.monotonic()
        self.is_ready = True
        return msg

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._from_scheduler.recv_pyobj()
            if isinstance(msg, list):
                for delta in msg:
                    stream = self.streams.get(delta.rid)
                    if stream is not None:  # None: the request was aborted and its stream closed
                        stream.put(delta)
            elif isinstance(msg, Heartbeat):
                self.last_heartbeat = time.monotonic()
            elif isinstance(msg, ControlOutput):
                self.last_heartbeat = time.monotonic()
                future = self._controls.pop(msg.rid, None)
                if future is not None and not future.done():
                    future.set_result(msg.value)
            elif isinstance(msg, (ReadyMessage, Exception)):
                if self._ready is not None and not self._ready.done():
                    (self._ready.set_exception if isinstance(msg, Exception) else self._ready.set_result)(msg)

    @property
    def unavailable_reason(self) -> str | None:
        """None while the engine serves; else why it does not (down, or silent past the heartbeat timeout)."""
        if not self.is_ready:
            return self.down_reason
        silent_s = time.monotonic() - self.last_heartbeat
        if silent_s > self.env.heartbeat_timeout_s:
            return f"engine is not responding (no heartbeat for {silent_s:.0f} s)"
        return None

    def engine_lost(self, reason: str) -> None:
        """The scheduler process is gone: every open request and control call fails now, none waits on it."""
        self.is_ready = False
        self.down_reason = reason
        for stream in set(self.streams.values()):
            stream.fail(reason)
        for future in self._controls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        self._controls.clear()

    def send(self, msg) -> None:
        self._to_scheduler.send_pyobj(msg)

    # ---- requests ----
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def check(self, prompts: list[list[int]], params: SamplingParams, first_index: int = 0) -> None:
        """ValueError naming the field (input_ids[i], SamplingParams.*) if the request can never run here:
        bad params, bad token ids, a prompt (plus its max_new_tokens) beyond the context, or more sequences
        than the queue limit will ever admit."""
        info = self.info
        params.validate(info.vocab_size)
        for i, ids in enumerate(prompts, first_index):
            if not ids:
                raise ValueError(f"input_ids[{i}]: empty prompt")
            if not all(type(t) is int and 0 <= t < info.vocab_size for t in ids):
                raise ValueError(f"input_ids[{i}]: token ids must be ints in [0, {info.vocab_size})")
            if len(ids) >= info.max_position:
                raise ValueError(f"input_ids[{i}]: prompt of {len(ids)} tokens does not fit the model context "
                                 f"of {info.max_position} tokens")
            if len(ids) + params.max_new_tokens > info.max_position:
                raise ValueError(f"max_new_tokens: {params.max_new_tokens} new tokens after a prompt of {len(ids)} "
                                 f"exceed the model context of {info.max_position} tokens")
        num_seqs = len(prompts) * params.n
        if num_seqs > self.max_inflight_seqs:
            raise ValueError(f"n: {num_seqs} sequences can never fit this server's queue limit of "
                             f"{self.max_inflight_seqs}")

    def submit(self, prompts: list[list[int]], params: SamplingParams, first_index: int = 0) -> RequestStream:
        """Admit and send one request; ValueError (see check), EngineUnavailable or Overloaded refuse it with
        nothing counted."""
        reason = self.unavailable_reason
        if reason is not None:
            raise EngineUnavailable(reason)
        self.check(prompts, params, first_index)
        num_seqs = len(prompts) * params.n
        if self.num_inflight_seqs + num_seqs > self.max_inflight_seqs:
            self.num_rejected_overload += 1
            raise Overloaded(f"server is at its queue limit ({self.max_inflight_seqs} sequences in flight)")
        base = uuid.uuid4().hex[:12]
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, rids, params.n, self.env.request_timeout_s)
        self.num_inflight_seqs += num_seqs
        for rid in rids:
            self.streams[rid] = stream
        try:
            for rid, ids in zip(rids, prompts):
                self.send(GenerateReqInput(rid, ids, params))
        except BaseException:
            stream.close()  # what was sent is aborted, what was counted given back
            raise
        return stream

    async def control(self, kind: str) -> dict:
        """'stats' or 'flush_cache', answered by the scheduler process with its statistics; EngineUnavailable at
        once if it is down or silent, or after DEEPINFER_CONTROL_TIMEOUT."""
        reason = self.unavailable_reason
        if reason is not None:
            raise EngineUnavailable(reason)
        rid = f"control-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._controls[rid] = future
        self.send(ControlReq(rid, kind))
        try:
            return await asyncio.wait_for(future, self.env.control_timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"engine did not answer in {self.env.control_timeout_s:g} s "
                                    "(DEEPINFER_CONTROL_TIMEOUT)") from None
        finally:
            self._controls.pop(rid, None)

    def shutdown(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        try:
            self.send(ShutdownReq())
        except zmq.ZMQError:
            pass
        self._to_scheduler.close(linger=100)
        self._from_scheduler.close(linger=0)
        self._ctx.term()
