"""Running programs: one (run, optionally streaming on a background thread) or a batch on a thread pool."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import tqdm

from deepinfer_lang.backend import RuntimeBackend
from deepinfer_lang.config import global_config
from deepinfer_lang.interpreter import ProgramState, _current
from deepinfer_lang.ir import GenArgs

logger = logging.getLogger("deepinfer_lang")


def _call(state: ProgramState, func, args: tuple, kwargs: dict, capture_errors: bool) -> None:
    _current.program_id = state.program_id
    try:
        state.ret_value = func(state, *args, **kwargs)
    except Exception as e:
        if not capture_errors:
            raise
        state._error = e
        logger.warning("program %r failed: %r", state.program_name, e)
    finally:
        state._close()
    if global_config.verbosity >= 2:
        print(state._text)


def run_program(func, name: str, backend: RuntimeBackend, args: tuple, kwargs: dict, defaults: GenArgs,
                stream: bool) -> ProgramState:
    state = ProgramState(backend, name, defaults, is_streaming=stream)
    if not stream:
        _call(state, func, args, kwargs, capture_errors=False)
        return state

    def run_in_background() -> None:
        try:
            _call(state, func, args, kwargs, capture_errors=True)
        finally:
            with state._changed:
                state._finished.set()
                state._changed.notify_all()

    state._finished = threading.Event()
    state._owner = threading.Thread(target=run_in_background, name=f"deepinfer-lang-{name}", daemon=True)
    state._owner.start()
    return state


def run_program_batch(func, name: str, backend: RuntimeBackend, batch_kwargs: list[dict], defaults: GenArgs,
                      num_threads: int | str, progress_bar: bool) -> list[ProgramState]:
    """Run one program per kwargs dict on a thread pool; states in input order, each failure kept on its state.
    num_threads="auto": as many programs at once as the engine runs requests, enough to keep its batch full."""
    return list(run_program_batch_iter(func, name, backend, batch_kwargs, defaults, num_threads, progress_bar,
                                       in_order=False))


def run_program_batch_iter(func, name: str, backend: RuntimeBackend, batch_kwargs: list[dict], defaults: GenArgs,
                           num_threads: int | str, progress_bar: bool, in_order: bool = True):
    """run_program_batch as a generator (run_batch(generator_style=True)): the states in input order, each
    yielded once it and those before it finished. in_order=False: nothing is yielded before all finished."""
    if not batch_kwargs:
        return
    if len(batch_kwargs) > 1 and global_config.enable_precache_with_tracing:
        prefill_program_prefix(func, name, backend, defaults, batch_kwargs[0])
    limit = backend.max_running_requests if num_threads == "auto" else int(num_threads)

    def run_one(kwargs: dict) -> ProgramState:
        state = ProgramState(backend, name, defaults)
        _call(state, func, (), kwargs, capture_errors=True)
        return state

    num_workers = max(1, min(limit, len(batch_kwargs)))
    with ThreadPoolExecutor(num_workers, thread_name_prefix=f"deepinfer-lang-{name}") as pool:
        futures = [pool.submit(run_one, kwargs) for kwargs in batch_kwargs]
        with tqdm.tqdm(total=len(futures), desc=name, disable=not progress_bar) as bar:
            for future in futures:
                future.add_done_callback(lambda _: bar.update())
            if in_order:
                for future in futures:
                    yield future.result()
                return
            for _ in as_completed(futures):
                pass
    yield from (future.result() for future in futures)


def prefill_program_prefix(func, name: str, backend: RuntimeBackend, defaults: GenArgs, kwargs: dict) -> None:
    """The programs of a batch start together, before any of them has a prompt in the prefix cache, so each
    would compute a header they share (few-shot examples) itself. Run the first program as a probe up to its
    first model call and prefill the prompt it built: the others then find the shared part cached. Like
    SGLang's prefix tracing, the probe re-executes the program's code before that call, side effects included."""
    if not backend.is_prefix_cache_enabled:
        return
    probe = ProgramState(backend, name, defaults, is_prefix_probe=True)
    try:
        func(probe, **kwargs)
    except Exception:  # _PrefixEnd, or a failure that the program's real run reports
        pass
    if probe.ids:
        backend.cache_prefix(probe.ids)
