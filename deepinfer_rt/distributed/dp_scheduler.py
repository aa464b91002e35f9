"""The front scheduler of data-parallel attention: one ordinary Scheduler per EP rank, each over that rank's KV
pool (its own page allocator) and prefix cache, behind the one Scheduler interface the engine loop uses.

A new request is placed once, for its whole life (retractions included): on the rank that holds the longest
prefix of its tokens (at least SchedulerConfig.inflight_prefix_min_tokens), in its radix tree or in a request
it serves now (two requests sharing a long prompt, submitted together, land on one rank, the second reusing
the first's prefix); where no rank holds one (or several hold the same), on the rank with the fewest tokens to
serve. Siblings of an n > 1 request follow
their leader (they share its prompt pages). A step is every rank's own schedule, concatenated in rank order
(`DPBatch`); a rank whose schedule is empty runs an empty step in the workers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_rt.cache.base import NoPrefixCache, PrefixCache
from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.cache.radix_cache import RadixCache
from deepinfer_rt.config import SchedulerConfig
from deepinfer_rt.request import Req
from deepinfer_rt.scheduler.batch import ScheduledBatch
from deepinfer_rt.scheduler.scheduler import Scheduler

_MAX_PREFIX_CHECKS = 64
"""Requests per rank whose tokens a placement compares against (the most recently placed)."""


@dataclass
class RankPool:
    """What a scheduler needs of one rank's KV pool (the pages live in that worker)."""
    allocator: PageAllocator
    page_size: int

    @property
    def num_slots(self) -> int:
        return self.allocator.num_pages * self.page_size


@dataclass
class DPBatch(ScheduledBatch):
    """A step of every rank: `items` is the ranks' items in rank order, `parts[r]` rank r's own batch (its
    items and KV copies, in rank r's page numbers)."""
    parts: list[ScheduledBatch] = field(default_factory=list)

    def unfinished(self) -> "DPBatch":
        if not any(it.req.is_finished for it in self.items):
            return self
        return _merge([part.unfinished() for part in self.parts])


def _merge(parts: list[ScheduledBatch]) -> DPBatch:
    return DPBatch([it for part in parts for it in part.items], [], parts=parts)


class DPCache(PrefixCache):
    """Every rank's prefix cache seen as one, for the engine's flush and statistics."""

    def __init__(self, caches: list[PrefixCache]):
        self.caches = caches
        self.enabled = any(c.enabled for c in caches)

    def flush(self) -> None:
        for cache in self.caches:
            cache.flush()

    @property
    def num_cached_pages(self) -> int:
        return sum(c.num_cached_pages for c in self.caches)

    def stats(self) -> dict:
        """The radix caches' counters summed over ranks (the engine reports them as one cache's)."""
        total = {"num_cached_pages": 0, "num_hit_tokens": 0, "num_query_tokens": 0, "num_evicted_pages": 0}
        for cache in self.caches:
            if isinstance(cache, RadixCache):
                for key, value in cache.stats().items():
                    if key in total:
                        total[key] += value
        total["hit_rate"] = total["num_hit_tokens"] / total["num_query_tokens"] if total["num_query_tokens"] else 0.0
        total["dp_hit_tokens_per_rank"] = [getattr(c, "num_hit_tokens", 0) for c in self.caches]
        return total


class DPScheduler:
    def __init__(self, config: SchedulerConfig, pools: list[RankPool], enable_prefix_cache: bool, spec=None):
        self.caches: list[PrefixCache] = [
            RadixCache(p.allocator, p.page_size) if enable_prefix_cache else NoPrefixCache(p.allocator, p.page_size)
            for p in pools]
        self.ranks = [Scheduler(config, pool, cache, spec=spec) for pool, cache in zip(pools, self.caches)]
        self.cache = DPCache(self.caches)
        self.min_prefix_tokens = config.inflight_prefix_min_tokens
        """A rank's prefix counts for placement from this many tokens on."""
        self.rank_of: dict[int, int] = {}
        """rid -> the rank serving the request."""
        self.num_served = [0] * len(pools)
        """Requests placed on each rank since the start."""

    # ---- placement ----
    def add(self, req: Req) -> None:
        rank = self.rank_of.get(req.leader.rid) if req.leader is not None else None
        if rank is None:
            rank = self.place(req)
        self.rank_of[req.rid] = rank
        self.num_served[rank] += 1
        self.ranks[rank].add(req)

    def place(self, req: Req) -> int:
        """The rank holding the longest prefix of req's tokens; the least loaded one among equals."""
        def key(rank: int) -> tuple[int, int]:
            sched = self.ranks[rank]
            held = self.caches[rank].peek(req) if self.cache.enabled else 0
            if self.cache.enabled:
                recent = list(sched.running[-_MAX_PREFIX_CHECKS:]) + list(sched.waiting)[-_MAX_PREFIX_CHECKS:]
                held = max([held, *(_common_prefix(req.token_ids, r.token_ids, self.min_prefix_tokens)
                                     for r in recent)])
            held -= held % sched.page_size  # only whole pages are shared
            if held < self.min_prefix_tokens:
                held = 0  # a short shared start (a BOS, a chat header) is not worth an unbalanced placement
            load = sum(r.num_tokens - r.num_computed_tokens for r in sched.running) + sum(
                r.num_tokens for r in sched.waiting)
            return -held, load
        return min(range(len(self.ranks)), key=lambda r: (*key(r), r))

    # ---- the Scheduler interface, over every rank ----
    def schedule(self) -> DPBatch:
        return _merge([sched.schedule() for sched in self.ranks])

    def update(self, batch: DPBatch, num_accepted: dict[int, int] | None = None) -> None:
        """num_accepted: merged item index -> drafts accepted (speculation), handed to each rank by its index."""
        offset = 0
        for sched, part in zip(self.ranks, batch.parts):
            n = len(part.items)
            sched.update(part, {i - offset: a for i, a in (num_accepted or {}).items() if offset <= i < offset + n})
            offset += n

    def finish(self, req: Req) -> None:
        rank = self.rank_of.pop(req.rid, None)
        if rank is not None:
            self.ranks[rank].finish(req)

    def abort_waiting(self, req: Req) -> None:
        rank = self.rank_of.get(req.rid)
        if rank is not None:
            self.ranks[rank].abort_waiting(req)

    @property
    def waiting(self) -> list[Req]:
        return [r for sched in self.ranks for r in sched.waiting]

    @property
    def running(self) -> list[Req]:
        return [r for sched in self.ranks for r in sched.running]

    @property
    def has_work(self) -> bool:
        return any(sched.has_work for sched in self.ranks)

    @property
    def has_runnable(self) -> bool:
        return any(sched.has_runnable for sched in self.ranks)

    @property
    def num_retractions(self) -> int:
        return sum(sched.num_retractions for sched in self.ranks)


def _common_prefix(a: list[int], b: list[int], min_len: int) -> int:
    """Length of the common prefix of a and b, or 0 when shorter than min_len (slice compares run in C)."""
    n = min(len(a), len(b))
    if n < min_len or a[:min_len] != b[:min_len]:
        return 0
    lo, hi = min_len, n  # a[:lo] == b[:lo]; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
