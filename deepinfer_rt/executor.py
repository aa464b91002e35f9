"""Executor contract: what the engine loop needs from whatever runs the model.

Two implementations: the local `ModelRunner` (model + KV pool + CUDA graphs, in this process) and the
expert-parallel `WorkerPool` (the same runner in every EP worker process, fed over zmq). The engine never asks
which one it holds.

    launch(batch, prev) -> handle   start computing a step; returns without waiting for its tokens where the
                                    executor can (`prev`: the launched step before, whose sampled tokens the
                                    batch's in-flight inputs read on the device; None when there is none)
    collect(handle) -> RunResult    wait for a launched step; its sampled tokens, logprobs, accepted drafts
    run(batch) = collect(launch(batch, None))
    can_overlap(batch) -> bool      whether `batch` may be launched before the step before it is collected
    allocator, page_size, num_slots the KV page allocator the scheduler and the prefix cache hand out pages from
    stats() -> dict                 executor counters merged into Engine.stats
    shutdown()                      stop whatever the executor started (processes, threads)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from deepinfer_rt.cache.kv_pool import PageAllocator
    from deepinfer_rt.model_runner import RunResult
    from deepinfer_rt.scheduler.batch import ScheduledBatch


class Executor(Protocol):
    allocator: "PageAllocator"
    page_size: int
    num_slots: int

    def launch(self, batch: "ScheduledBatch", prev: Any = None) -> Any: ...

    def collect(self, handle: Any) -> "RunResult": ...

    def run(self, batch: "ScheduledBatch") -> "RunResult": ...

    def can_overlap(self, batch: "ScheduledBatch") -> bool: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...
