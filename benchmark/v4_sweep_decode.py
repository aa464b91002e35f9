"""The decode machinery of bench_v4_sweep.py: random compact-pool state in place of a prefill, running requests set
at their last prompt position, and decode steps driven through the engine's executor as the engine loop drives them."""
from __future__ import annotations

import contextlib
import itertools
import re
import time

import torch

from bench_gpu import _cuda_time as cuda_time  # median seconds by CUDA events
from deepinfer_rt import SamplingParams
from deepinfer_rt.request import Req, ReqStatus
from deepinfer_rt.scheduler.batch import ScheduledBatch, ScheduledReq

_RIDS = itertools.count(1 << 40)
"""Request ids of the benchmark's own requests (the page table keys rows by id): far from the engine's."""
_LAYER_OF = re.compile(r"layers\.(\d+)\.")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def fill_pool(pool, seed: int = 0) -> None:
    """Random state in every row of the pool (entries, recent rows, FP8 rows with their scales)."""
    torch.manual_seed(seed)
    chunk = 1 << 18
    for buf in [*pool.recent, *pool.entries]:
        for i in range(0, buf.shape[0], chunk):
            buf[i : i + chunk].normal_()
    for rows in [*pool.fp8_swa, *pool.fp8_entry, *pool.fp8_idx_entry]:
        if rows is not None and rows.values.numel():
            n, width = rows.values.shape
            for i in range(0, n, chunk):
                idx = torch.arange(i, min(n, i + chunk), device=rows.values.device)
                rows.write(idx, torch.randn(idx.numel(), width, device=rows.values.device))
    _sync()


def pool_tensor_bytes(pool) -> int:
    bufs = [*pool.recent, *pool.entries]
    for rows in [*pool.fp8_swa, *pool.fp8_entry, *pool.fp8_idx_entry]:
        if rows is not None:
            bufs += [rows.values, rows.scales]
    return sum(b.numel() * b.element_size() for b in bufs)


# ---- decode ----

def new_requests(engine, batch: int, context: int, tokens_per_seq: int) -> list[Req]:
    """`batch` running requests at position context - 1 (its prompt computed but the last token), with pages for
    the whole run and recent rows for the positions the next step reads."""
    pool, ps = engine.pool, engine.pool.page_size
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    reqs = []
    for i in range(batch):
        params = SamplingParams(max_new_tokens=tokens_per_seq, temperature=1.0, ignore_eos=True, seed=i)
        req = Req(next(_RIDS), torch.randint(0, vocab, (context,), generator=gen).tolist(), params, seed=i)
        req.status = ReqStatus.RUNNING
        pages = pool.allocator.alloc(tokens_per_seq // ps)
        if pages is None:
            raise RuntimeError(f"the pool has no room for {batch} x {tokens_per_seq} tokens")
        req.pages, req.num_computed_tokens = pages, context - 1
        reqs.append(req)
        start = context - 1
        for page in pages[max(0, start - pool.layout.recent_tokens) // ps : start // ps + 1]:
            if not pool.has_recent(page):
                pool._attach(page, set())  # as the prefill would have left them
    pool._sync()
    return reqs


def release(engine, reqs: list[Req]) -> None:
    for r in reqs:
        r.finish("length")
        engine.pool.allocator.decref(r.pages)


def decode_steps(runner, reqs: list[Req], n: int, collected: list[float] | None = None) -> None:
    """n decode steps of all `reqs`, launched and collected as the engine loop does (a step that can overlap is
    launched before the one before it is collected). `collected` gets the host clock as each step's tokens
    arrive: from the first on, the pipeline is full (the next step was launched before it was collected)."""
    inflight = None

    def complete(handle, overlapped: bool) -> None:
        result = runner.collect(handle)
        if collected is not None:
            collected.append(time.perf_counter())
        for i, token in result.sampled:
            reqs[i].token_ids.append(token)
            reqs[i].num_inflight_tokens -= overlapped

    for _ in range(n):
        batch = ScheduledBatch([ScheduledReq.of(r, 1) for r in reqs])
        overlapped = runner.can_overlap(batch)
        if not overlapped and inflight is not None:
            complete(*inflight)
            inflight = None
        handle = runner.launch(batch, inflight[0] if inflight is not None else None)
        if inflight is not None:
            complete(*inflight)
        for r in reqs:
            r.num_computed_tokens += 1
            r.num_inflight_tokens += overlapped
        inflight = (handle, overlapped)
        if not overlapped:
            complete(*inflight)
            inflight = None
    if inflight is not None:
        complete(*inflight)
    _sync()


@contextlib.contextmanager
def routing_counts(model):
    """Distinct experts each MoE layer's router picked, per step (forward hooks on the routers)."""
    from deepinfer_rt.models.deepseek_v4.moe import V4Router

    counts: dict[int, list[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, V4Router):
            layer = int(_LAYER_OF.search(name)[1])
            hooks.append(module.register_forward_hook(
                lambda m, inp, out, layer=layer: counts.setdefault(layer, []).append(int(out[1].unique().numel()))))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()
