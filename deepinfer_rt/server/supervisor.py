"""The HTTP process's watch over the engine (scheduler) process: start it, notice its death within a fraction of
a second, end every open request with an error at once, restart it (DEEPINFER_ENGINE_MAX_RESTARTS times,
logged) or give up, after which the server exits non-zero. A live but stuck engine (no heartbeat) is the
TokenizerManager's to report; the supervisor only acts on death."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os

from deepinfer_rt.env import get_env
from deepinfer_rt.server.scheduler_process import run_scheduler_process
from deepinfer_rt.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0
_POLL_S = 0.2


class EngineSupervisor:
    def __init__(self, engine_kwargs: dict, to_sched: str, from_sched: str):
        self.engine_kwargs = engine_kwargs
        self.to_sched = to_sched
        self.from_sched = from_sched
        self.max_restarts = get_env().engine_max_restarts
        self.proc: multiprocessing.Process | None = None
        self.fatal: str | None = None
        """Set when the engine is dead for good: the server should exit non-zero."""

    def spawn(self) -> None:
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_scheduler_process, daemon=True,
            args=(self.engine_kwargs, self.to_sched, self.from_sched, os.getpid()))
        self.proc.start()

    async def wait_ready(self, tm: TokenizerManager) -> None:
        """Until the engine process is up; RuntimeError if it fails or dies while loading."""
        ready = asyncio.ensure_future(tm.wait_ready(_READY_TIMEOUT_S))
        while not ready.done():
            await asyncio.wait({ready}, timeout=_POLL_S)
            if not ready.done() and not self.proc.is_alive():
                ready.cancel()
                raise RuntimeError(f"scheduler process exited with code {self.proc.exitcode} while loading the "
                                   "model")
        ready.result()
        tm.scheduler_pid = self.proc.pid

    async def watch(self, tm: TokenizerManager, on_fatal) -> None:
        """Runs for the server's life: on each death, fail what is open, then restart or call on_fatal()."""
        num_restarts = 0
        while True:
            while self.proc.is_alive():
                await asyncio.sleep(_POLL_S)
            reason = f"engine process exited with code {self.proc.exitcode}"
            logger.error("%s; %d open requests fail", reason, len(set(tm.streams.values())))
            tm.engine_lost(reason)
            while True:
                if num_restarts >= self.max_restarts:
                    self.fatal = f"{reason}; gave up after {num_restarts} restarts (DEEPINFER_ENGINE_MAX_RESTARTS)"
                    logger.error("%s: the server exits", self.fatal)
                    tm.down_reason = self.fatal
                    on_fatal()
                    return
                num_restarts += 1
                tm.num_engine_restarts = num_restarts
                tm.down_reason = f"{reason}; restarting it ({num_restarts}/{self.max_restarts})"
                logger.warning("restarting the engine process (%d/%d)", num_restarts, self.max_restarts)
                self.spawn()
                try:
                    await self.wait_ready(tm)
                    break
                except (RuntimeError, asyncio.TimeoutError) as e:
                    reason = str(e)
                    logger.error("engine restart failed: %s", reason)
            logger.warning("engine process restarted (pid %d)", self.proc.pid)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
