"""The HTTP process's side of the runtime: tokenizes, admits (queue limit), sends requests to the scheduler
process over pyzmq and routes the deltas coming back to the request that waits for them."""
from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import AsyncIterator

import zmq
import zmq.asyncio

from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.server.io_struct import (AbortReq, ControlOutput, ControlReq, GenerateReqInput, ReadyMessage,
                                           SeqDelta, ShutdownReq)
from deepinfer_rt.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """More sequences in flight than the queue limit allows; the client should retry later."""


class RequestStream:
    """The sequences of one HTTP request (one engine request per prompt, each with params.n sequences), their
    deltas merged in arrival order with indexes prompt_index * n + k."""

    def __init__(self, manager: "TokenizerManager", rids: list[str], n: int):
        self.manager = manager
        self.queue: asyncio.Queue[SeqDelta | Exception] = asyncio.Queue()
        self.num_open = len(rids) * n
        self._index_offsets = {rid: i * n for i, rid in enumerate(rids)}
        self.open_rids = set(rids)
        self._num_open_per_rid = {rid: n for rid in rids}

    def put(self, delta: SeqDelta) -> None:
        delta.index += self._index_offsets[delta.rid]
        self.queue.put_nowait(delta)

    def fail(self, message: str) -> None:
        self.queue.put_nowait(RuntimeError(message))

    async def __aiter__(self) -> AsyncIterator[SeqDelta]:
        """Deltas until every sequence finished; a rejected prompt raises ValueError (its message), a failed
        scheduler process RuntimeError."""
        while self.num_open:
            delta = await self.queue.get()
            if isinstance(delta, Exception):
                self.close()
                raise delta
            if delta.is_rejected:
                self.close()
                raise ValueError(delta.error)
            if delta.is_finished:
                self._finish_seq(delta.rid)
            yield delta

    def _finish_seq(self, rid: str, count: int = 1) -> None:
        self.num_open -= count
        self.manager.num_inflight_seqs -= count
        self._num_open_per_rid[rid] -= count
        if not self._num_open_per_rid[rid]:
            self.open_rids.discard(rid)
            self.manager.streams.pop(rid, None)

    def close(self) -> None:
        """Abort whatever has not finished (client gone, or a sibling prompt was rejected); frees its KV."""
        for rid in list(self.open_rids):
            self.manager.send(AbortReq(rid))
            self._finish_seq(rid, self._num_open_per_rid[rid])
        self.num_open = 0


class TokenizerManager:
    def __init__(self, model_path: str, to_scheduler_addr: str, from_scheduler_addr: str, max_queued_seqs: int):
        self.tokenizer = load_tokenizer(model_path)
        self.max_queued_seqs = max_queued_seqs
        self.max_inflight_seqs = 0  # the queue limit, once ready: the engine's max_num_seqs + max_queued_seqs
        self.num_inflight_seqs = 0
        self.num_rejected_overload = 0
        self.streams: dict[str, RequestStream] = {}
        self.info: ReadyMessage | None = None
        self.scheduler_pid: int | None = None
        self._controls: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._ctx = zmq.asyncio.Context()
        self._to_scheduler = self._ctx.socket(zmq.PUSH)
        self._to_scheduler.bind(to_scheduler_addr)
        self._from_scheduler = self._ctx.socket(zmq.PULL)
        self._from_scheduler.bind(from_scheduler_addr)
        self._recv_task: asyncio.Task | None = None

    async def wait_ready(self, timeout_s: float) -> ReadyMessage:
        msg = await asyncio.wait_for(self._from_scheduler.recv_pyobj(), timeout_s)
        if isinstance(msg, Exception):
            raise msg
        self.info = msg
        self.max_inflight_seqs = msg.max_num_seqs + self.max_queued_seqs
        self._recv_task = asyncio.create_task(self._recv_loop())
        return msg

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._from_scheduler.recv_pyobj()
            if isinstance(msg, ControlOutput):
                future = self._controls.pop(msg.rid, None)
                if future is not None and not future.done():
                    future.set_result(msg.value)
                continue
            for delta in msg:
                stream = self.streams.get(delta.rid)
                if stream is not None:  # None: the request was aborted and its stream closed
                    stream.put(delta)

    def fail_all(self, message: str) -> None:
        """The scheduler process is gone: every waiting request fails instead of waiting forever."""
        for stream in set(self.streams.values()):
            stream.fail(message)

    def send(self, msg) -> None:
        self._to_scheduler.send_pyobj(msg)

    # ---- requests ----
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> RequestStream:
        num_seqs = len(prompts) * params.n
        if self.num_inflight_seqs + num_seqs > self.max_inflight_seqs:
            self.num_rejected_overload += 1
            raise Overloaded(f"server is at its queue limit ({self.max_inflight_seqs} sequences in flight)")
        base = uuid.uuid4().hex[:12]
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, rids, params.n)
        self.num_inflight_seqs += num_seqs
        for rid, ids in zip(rids, prompts):
            self.streams[rid] = stream
            self.send(GenerateReqInput(rid, ids, params))
        return stream

    async def control(self, kind: str) -> dict:
        """'stats' or 'flush_cache', answered by the scheduler process with its statistics."""
        rid = f"control-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._controls[rid] = future
        self.send(ControlReq(rid, kind))
        return await asyncio.wait_for(future, 30.0)

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
