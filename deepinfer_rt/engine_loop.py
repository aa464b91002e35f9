"""The engine's one loop: a background thread that steps while any request is unfinished and sleeps when idle.

Callers never step the engine. `generate`, `stream`, the async forms and the server's `add_request` build their
requests on their own thread, `post` them to the loop (which admits them before its next step) and wait on
their own requests; so requests from any number of threads or asyncio tasks share every step's batch. Whatever
touches the scheduler (admission, aborts, cache flushes) runs on the loop's thread (`post` / `call`), so the
scheduler, the KV pool and the prefix cache are only ever used by one thread at a time.

A step that raises fails its own requests (the engine's `on_step_error`) and the loop goes on. If the loop
itself dies, every waiting caller gets a RuntimeError saying why, and so does every later call.

`hold()` parks the loop so that one thread drives `step()` by hand (tests, host-time benchmarks); while held,
waits on that thread step the engine themselves instead of sleeping.

The loop keeps only weak references to the engine: an engine dropped without `shutdown()` is collected, and its
parked thread ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from typing import Any, Callable, Iterator

logger = logging.getLogger("deepinfer_rt")


class EngineLoop:
    def __init__(self, step: Callable[[], Any], on_step_error: Callable[[BaseException], None],
                 has_work: Callable[[], bool]):
        self._step = weakref.WeakMethod(step)
        self._on_step_error = weakref.WeakMethod(on_step_error)
        self._has_work = weakref.WeakMethod(has_work)
        self.cond = threading.Condition()
        """Held while the loop admits requests and while a step applies its tokens (stream readers take text
        deltas under it); its waiters are woken after every step."""
        self._inbox: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._holder: int | None = None
        self._is_parked = False
        self._is_stopping = False
        self.is_closed = False
        self.error: str | None = None
        """Why the loop thread died, once it has."""
        self.num_steps = 0
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # ---- what callers use ----
    def post(self, op: Callable[[], None]) -> None:
        """Run `op` on the loop's thread before its next step (at once on the thread that drives the loop)."""
        with self.cond:
            self._check_alive()
            if self._drives_here():
                op()
                return
            self._inbox.append(op)
            self._start()
            self.cond.notify_all()

    def call(self, op: Callable[[], Any]) -> Any:
        """Run `op` on the loop's thread and return its result (inline when no thread runs the loop)."""
        with self.cond:
            self._check_alive()
            if self._drives_here() or self._thread is None:
                return op()
            outcome: dict[str, Any] = {}

            def run() -> None:
                try:
                    outcome["value"] = op()
                except BaseException as e:  # noqa: BLE001 -- handed to the caller
                    outcome["error"] = e
            self._inbox.append(run)
            self.cond.notify_all()
        self.wait(lambda: bool(outcome))
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def wait(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Until `predicate()` holds (checked after every step), or `timeout_s`; RuntimeError if the loop died
        or was closed first."""
        if self._drives_here():
            has_work = self._has_work()
            while not predicate():
                if not has_work():
                    raise RuntimeError("nothing left to step, yet the awaited requests are not finished")
                self._step_once()
            return True
        with self.cond:
            ok = self.cond.wait_for(lambda: predicate() or self.error is not None or self.is_closed, timeout_s)
            if not predicate():
                self._check_alive()
            return bool(ok) and predicate()

    async def async_wait(self, predicate: Callable[[], bool]) -> None:
        """`wait` for asyncio tasks: the loop's thread wakes them through their event loop."""
        if self._drives_here():
            raise RuntimeError("an asyncio task cannot wait on the thread that holds the engine loop")
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self.cond:
            self._async_waiters.add(waiter)
        try:
            while True:
                waiter[1].clear()
                if predicate():
                    return
                self._check_alive()
                await waiter[1].wait()
        finally:
            with self.cond:
                self._async_waiters.discard(waiter)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self.cond:
            if self._holder is not None:
                raise RuntimeError("the engine loop is already held")
            self._holder = threading.get_ident()
            self.cond.notify_all()
            self.cond.wait_for(lambda: self._thread is None or self._is_parked or self.error is not None)
            ops, self._inbox = self._inbox, []
            for op in ops:  # submitted before the hold: the holder's steps must see them
                op()
        try:
            yield
        finally:
            with self.cond:
                self._holder = None
                self.cond.notify_all()

    def check_driver(self) -> None:
        """Raise unless the calling thread may step the engine (the loop's own thread, or the holder)."""
        if not self._drives_here() and self._thread is not None:
            raise RuntimeError("the engine loop steps the engine; call step() only inside engine.hold_loop()")

    def stop(self) -> None:
        """End the loop thread after its current step (shutdown's first half: no step runs afterwards)."""
        with self.cond:
            self._is_stopping = True
            self.cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=120)

    def close(self) -> None:
        """Refuse new work and wake every waiter (they find their requests finished, or get an error)."""
        with self.cond:
            self._is_stopping = self.is_closed = True
            self.cond.notify_all()
        self._wake_async()

    # ---- the thread ----
    def _drives_here(self) -> bool:
        me = threading.get_ident()
        return self._holder == me or (self._thread is not None and self._thread.ident == me)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine loop died: {self.error}")
        if self.is_closed:
            raise RuntimeError("engine is shut down")

    def _start(self) -> None:
        if self._thread is None and not self._is_stopping:
            self._thread = threading.Thread(target=self._run, name="deepinfer-engine-loop", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self._is_stopping and (self._holder is not None or not self._is_busy()):
                        self._is_parked = True
                        self.cond.notify_all()  # a holder waits for the park
                        self.cond.wait()
                    self._is_parked = False
                    if self._is_stopping:
                        return
                    ops, self._inbox = self._inbox, []
                for op in ops:
                    op()
                has_work = self._has_work()
                if has_work is None:
                    return  # the engine is gone
                if has_work():
                    self._step_once()
                del has_work
        except BaseException as e:  # noqa: BLE001 -- recorded; every waiter is told
            logger.exception("the engine loop died")
            with self.cond:
                self.error = f"{type(e).__name__}: {e}"
                self.cond.notify_all()
            self._wake_async()
        finally:
            with self.cond:
                self._is_parked = True
                self.cond.notify_all()

    def _is_busy(self) -> bool:
        if self._inbox:
            return True
        has_work = self._has_work()
        return has_work is None or has_work()

    def _step_once(self) -> None:
        step = self._step()
        if step is None:
            return
        try:
            step()
        except Exception as e:  # noqa: BLE001 -- a fault of this step: its requests fail, the loop goes on
            logger.exception("engine step failed; failing its requests")
            on_error = self._on_step_error()
            if on_error is not None:
                with self.cond:
                    on_error(e)
        del step
        with self.cond:
            self.num_steps += 1
            self.cond.notify_all()
        self._wake_async()

    def _wake_async(self) -> None:
        with self.cond:
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop is closed
                pass
