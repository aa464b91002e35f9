"""Continuous-batching scheduler: waiting -> running -> finished, over a token budget per step."""
from __future__ import annotations

import logging
from collections import deque

from deepinfer_rt.cache.base import PrefixCache
from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.config import SchedulerConfig
from deepinfer_rt.request import Req, ReqStatus
from deepinfer_rt.scheduler.batch import ScheduledBatch, ScheduledReq
from deepinfer_rt.scheduler.policy import order_waiting

logger = logging.getLogger(__name__)


_MAX_INFLIGHT_CHECKS = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, cache: PrefixCache, spec=None):
        self.config = config
        self.pool = pool
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0
        self.spec = spec
        """SpecDecoder when speculation is on: decoding requests then also verify drafts it plans."""

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        # Every request has num_computed_tokens catching up to num_tokens (prompt + outputs so far). A step
        # hands out a token budget: running requests first (a decode is 1 token, an unfinished prefill its
        # next chunk), then waiting requests are admitted in policy order, each starting at its cached prefix.
        # When the pool cannot grow a running request, the running request that loses least is retracted:
        # its pages are released (its prefix stays in the cache) and it waits again to recompute; nothing
        # is lost. A request samples a token in the step where it catches up.
        budget = self.config.chunked_prefill_tokens
        batch = ScheduledBatch()
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted earlier in this loop
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            if not self._grow(req, num_new, batch):
                continue
            batch.items.append(ScheduledReq.of(req, num_new))
            budget -= num_new
        if self.spec is not None:
            budget -= self._add_drafts(batch, budget)
        self._admit(batch, budget)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> int:
        """Speculation: decoding items also verify the drafts the planner gives them, where free pages allow
        (drafts never evict or retract). Returns the tokens added."""
        items = [(i, it) for i, it in enumerate(batch.items) if it.num_new_tokens == 1 and it.is_sampling]
        used = 0
        plans = self.spec.plan([it.req for _, it in items], batch.num_tokens, budget)
        for (i, item), drafts in zip(items, plans):
            req = item.req
            need = _cdiv(item.start + 1 + len(drafts), self.page_size) - len(req.pages)
            spares = req.spare_pages[: max(need, 0)]
            pages = self.allocator.alloc(need - len(spares)) if need > len(spares) else []
            if drafts and pages is not None:
                del req.spare_pages[: len(spares)]
                req.pages.extend(spares + pages)
                batch.items[i] = item.with_drafts(drafts)
                used += len(drafts)
        return used

    def _grow(self, req: Req, num_new: int, batch: ScheduledBatch) -> bool:
        """Make req's pages cover num_computed_tokens + num_new, retracting others if needed."""
        need = _cdiv(req.num_computed_tokens + num_new, self.page_size) - len(req.pages)
        if need > 0 and req.spare_pages:
            req.pages.extend(req.spare_pages[:need])
            del req.spare_pages[:need]
            need = _cdiv(req.num_computed_tokens + num_new, self.page_size) - len(req.pages)
        while need > 0:
            pages = self._alloc_with_spares(req, need) if num_new == 1 else self._alloc(need)
            if pages is not None:
                req.pages.extend(pages)
                return True
            victims = [r for r in self.running if r is not req]
            if not victims:
                # Alone and still too big for the pool: it can never finish.
                self._drop(req)
                req.finish("length" if req.num_output_tokens else "error",
                           None if req.num_output_tokens else "request does not fit in the KV pool")
                return False
            victim = min(victims, key=lambda r: (r.num_output_tokens, -r.prompt_len, -r.rid))
            batch.items = [it for it in batch.items if it.req is not victim]
            self.retract(victim)
        return True

    def _alloc_with_spares(self, req: Req, need: int) -> list[int] | None:
        """Decode grows a request one token at a time; taking a few pages ahead keeps its KV in contiguous
        runs (slots of concurrent decodes would otherwise interleave, which makes reading KV back several
        times slower). Spares are real references, reclaimed before anything is evicted or retracted."""
        extra = min(_cdiv(self.config.decode_reserve_tokens, self.page_size) - 1,
                    _cdiv(req.params.max_new_tokens - req.num_output_tokens, self.page_size))
        if extra > 0 and self.allocator.num_free >= need + extra:
            pages = self.allocator.alloc(need + extra)
            req.spare_pages = pages[need:]
            return pages[:need]
        return self._alloc(need)

    def _alloc(self, num_pages: int) -> list[int] | None:
        if self.allocator.num_free < num_pages:
            for r in self.running:
                self._free_spares(r)
        if self.allocator.num_free < num_pages:
            self.cache.evict(num_pages - self.allocator.num_free)
        return self.allocator.alloc(num_pages)

    def _free_spares(self, req: Req) -> None:
        if req.spare_pages:
            self.allocator.decref(req.spare_pages)
            req.spare_pages = []

    def retract(self, req: Req) -> None:
        self._drop(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        logger.info("retracted request %d (%d tokens) to free KV pages", req.rid, req.num_tokens)

    def _drop(self, req: Req) -> None:
        """Take req out of running and give back its pages (its computed prefix is offered to the cache)."""
        if req in self.running:
            self.running.remove(req)
        if req.num_computed_tokens:
            self.cache.insert(req, req.num_computed_tokens)
        self.cache.release(req)
        self._free_spares(req)  # first: the pages freed last are handed out first (PageAllocator)
        self.allocator.decref(req.pages)
        req.pages = []
        req.num_computed_tokens = 0

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        ordered = order_waiting(list(self.waiting), self.config.schedule_policy, self.cache,
                                self.config.lpm_fallback_queue_len)
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.is_grammar_pending:
                continue  # waits, without blocking others, until its grammar is compiled
            leader = req.leader
            if leader is not None and leader.status is not ReqStatus.FINISHED:
                if leader.status is ReqStatus.WAITING or leader.num_computed_tokens < req.prompt_len - 1:
                    continue  # the shared prompt is not computed yet
                if not self._share_prompt(req, leader, batch):
                    break
            else:
                if self._shares_inflight_prefill(req):
                    continue  # admitted next step, it reuses the prefix instead of computing it again
                pages, num_cached = self.cache.match(req)
                if req.wants_prompt_logprobs:
                    # Rows from the first wanted position - 1 on must be computed to score the prompt.
                    limit = (len(req.prompt_logprobs) - 1) // self.page_size * self.page_size
                    if num_cached > limit and self.allocator.prefix_guard is not None:
                        # A pool that resumes only where its state was kept (compact DeepSeek-V4) cuts further.
                        limit = self.allocator.prefix_guard.restorable(pages, limit)
                        self.allocator.prefix_guard.keep(pages[: limit // self.page_size], limit)
                    if num_cached > limit:
                        self.allocator.decref(pages[limit // self.page_size :])
                        pages, num_cached = pages[: limit // self.page_size], limit
                req.pages, req.num_computed_tokens = pages, num_cached
                req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            need = _cdiv(req.num_computed_tokens + num_new, self.page_size) - len(req.pages)
            pages = self._alloc(need) if need > 0 else []
            if pages is None:
                self.cache.release(req)
                self.allocator.decref(req.pages)
                req.pages, req.num_computed_tokens = [], 0
                if not self.running and not batch.items:
                    # Even an empty pool cannot hold this chunk: fail the request instead of waiting forever.
                    self.waiting.remove(req)
                    req.finish("error", f"prompt chunk of {num_new} tokens does not fit in the KV pool of "
                                        f"{self.pool.num_slots} slots")
                    continue
                break
            req.pages.extend(pages)
            self.waiting.remove(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            batch.items.append(ScheduledReq.of(req, num_new))
            budget -= num_new

    def _shares_inflight_prefill(self, req: Req) -> bool:
        """True when a request still prefilling computes a prefix of req's tokens that the cache does not hold
        yet (by at least `inflight_prefix_min_tokens`): two requests admitted together would both compute it."""
        if not self.cache.enabled:
            return False
        threshold = self.config.inflight_prefix_min_tokens
        cached = self.cache.peek(req)
        tokens = req.token_ids
        for other in self.running[-_MAX_INFLIGHT_CHECKS:]:
            if other.num_computed_tokens >= other.prompt_len:
                continue
            n = min(len(tokens), other.prompt_len)
            if n - cached < threshold or tokens[cached + threshold - 1] != other.token_ids[cached + threshold - 1]:
                continue
            if tokens[: cached + threshold] == other.token_ids[: cached + threshold]:
                return True
        return False

    def _share_prompt(self, req: Req, leader: Req, batch: ScheduledBatch) -> bool:
        """n > 1: start req from its leader's computed prompt, all but the last token (which req computes to
        get its own logits). Whole pages are shared; a partly filled last page is copied."""
        num_shared = req.prompt_len - 1
        if self.allocator.prefix_guard is not None:  # the compact DeepSeek-V4 pool: only where state was kept
            num_shared = self.allocator.prefix_guard.restorable(leader.pages, num_shared)
            self.allocator.prefix_guard.keep(leader.pages, num_shared)
        num_full, rem = divmod(num_shared, self.page_size)
        pages = leader.pages[:num_full]
        self.allocator.incref(pages)
        if rem:
            tail = self._alloc(1)
            if tail is None:
                self.allocator.decref(pages)
                return False
            src = leader.pages[num_full] * self.page_size
            dst = tail[0] * self.page_size
            batch.kv_copies.append((list(range(src, src + rem)), list(range(dst, dst + rem))))
            pages = pages + tail
        req.pages, req.num_computed_tokens = pages, num_shared
        req.num_cached_tokens = max(req.num_cached_tokens, num_shared)
        return True

    def update(self, batch: ScheduledBatch, num_accepted: dict[int, int] | None = None) -> None:
        """Once the step is launched: advance computed counts and offer completed prompt chunks to the cache
        (their KV is written before any later step reads it). Speculation: the step must be completed first,
        `num_accepted` (item index -> drafts verification accepted) saying how far each request got."""
        for i, item in enumerate(batch.items):
            req = item.req
            req.num_computed_tokens = item.start + item.num_input_tokens + (num_accepted or {}).get(i, 0)
            if self.allocator.prefix_guard is not None and item.start < req.prompt_len <= req.num_computed_tokens:
                self.allocator.prefix_guard.keep_prompt(req.pages, req.prompt_len)  # resumable at its end
            if item.draft_tokens:
                # Roll back rejected drafts: their KV is garbage, and pages past the verified tokens go back.
                self.allocator.decref(req.cut_pages(_cdiv(req.num_computed_tokens, self.page_size)))
            if req.num_computed_tokens < req.num_tokens:
                self.cache.insert(req, req.num_computed_tokens)  # a long prompt is reusable chunk by chunk

    def finish(self, req: Req) -> None:
        """Release a finished request's pages (its tokens are offered to the cache first)."""
        if req in self.running:
            self.running.remove(req)
        # A stop inside accepted drafts leaves verified KV past the last kept token.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        # The spares first: the pages freed last are handed out first (PageAllocator), so the next sequence gets
        # this one's pages in their order and its slots stay consecutive where these were.
        self._free_spares(req)
        if req.pages:
            self.cache.insert(req, req.num_computed_tokens)
            self.cache.release(req)
            self.allocator.decref(req.pages)
            req.pages = []

    def abort_waiting(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_runnable(self) -> bool:
        return bool(self.running) or any(not r.is_grammar_pending for r in self.waiting)
