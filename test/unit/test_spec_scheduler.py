"""Scheduler with drafts, no model: pages cover drafts while they are verified, rejected positions are rolled
back (pages past the verified length freed), the prefix cache only ever holds verified tokens, and outputs do
not depend on drafting, paging, caching or retraction."""
from __future__ import annotations

import pytest
import torch
from scheduler_fakes import CPU, LAYOUT, cdiv, expected_output, fake_token, make_req

from deepinfer_rt.cache.kv_pool import KVPool, slots_of
from deepinfer_rt.cache.radix_cache import RadixCache
from deepinfer_rt.config import SchedulerConfig
from deepinfer_rt.scheduler.scheduler import Scheduler


class FakeSpec:
    """Plans the true next tokens with every third draft corrupted, up to 3 per request."""

    def plan(self, reqs, base_tokens, budget):
        out = []
        for r in reqs:
            k = min(3, r.params.max_new_tokens - r.num_output_tokens - 1, max(budget, 0))
            drafts = [fake_token(r, r.num_tokens + i) + (1 if (r.num_tokens + i) % 3 == 0 else 0)
                      for i in range(max(k, 0))]
            budget -= len(drafts)
            out.append(drafts)
        return out


def kv_rows(tokens: list[int], positions: range) -> torch.Tensor:
    return torch.tensor([[float(tokens[p]), float(p), 1.0, 0.0] for p in positions]).view(-1, 1, 4)


@pytest.mark.parametrize("page_size,num_pages,budget", [(1, 512, 64), (3, 200, 64), (2, 40, 16)])
def test_drafts_rollback_and_cache(page_size, num_pages, budget):
    pool = KVPool(LAYOUT, num_pages, page_size, torch.float32, CPU)
    cache = RadixCache(pool.allocator, page_size)
    sched = Scheduler(SchedulerConfig(chunked_prefill_tokens=budget), pool, cache)
    sched.spec = FakeSpec()
    shared = list(range(500, 520))
    reqs = [make_req(0, 12, prompt=shared + [i, i + 1]) for i in range(6)] + [make_req(9, 15), make_req(30, 4)]
    for r in reqs:
        sched.add(r)
    num_drafted = num_accepted = 0
    for _ in range(500):
        if not sched.has_work:
            break
        batch = sched.schedule()
        accepted = {}
        for i, item in enumerate(batch.items):
            req, start = item.req, item.start
            assert len(req.pages) * page_size >= start + item.num_new_tokens
            # Verified KV so far is intact (rolled-back slots were never read as valid).
            if start:
                got = pool.k[0][torch.tensor(slots_of(req.pages, start, page_size))]
                assert torch.equal(got, kv_rows(req.token_ids, range(start)))
            tokens = req.token_ids[: start + item.num_new_tokens - len(item.draft_tokens)] + list(item.draft_tokens)
            slots = slots_of(req.pages, start + item.num_new_tokens, page_size)[start:]
            pool.write(0, torch.tensor(slots), kv_rows(tokens, range(start, len(tokens))), None)
            truth = [fake_token(req, req.num_tokens + i) for i in range(len(item.draft_tokens))]
            accepted[i] = next((j for j, (d, t) in enumerate(zip(item.draft_tokens, truth)) if d != t), len(truth))
            num_drafted += len(item.draft_tokens)
            num_accepted += accepted[i]
        emitting = [(it.req, accepted[i] + 1) for i, it in enumerate(batch.items) if it.is_sampling]
        sched.update(batch, accepted)
        for item in batch.items:
            if item.draft_tokens:  # rolled back to the verified length
                assert len(item.req.pages) == cdiv(item.req.num_computed_tokens, page_size)
        for req, n in emitting:
            for _ in range(n):
                req.token_ids.append(fake_token(req, req.num_tokens))
                if req.num_output_tokens >= req.params.max_new_tokens:
                    req.finish("length")
                    sched.finish(req)
                    break
    assert all(r.is_finished for r in reqs)
    assert 0 < num_accepted < num_drafted
    assert (sched.num_retractions > 0) == (num_pages < 50)
    for r in reqs:
        assert r.output_ids == expected_output(r, r.params.max_new_tokens)
    # Everything cached is verified: a fresh request sharing the prompt reads correct KV from the tree.
    probe = make_req(0, 1, prompt=reqs[0].token_ids + [1])
    pages, num_cached = cache.match(probe)
    if num_cached:
        got = pool.k[0][torch.tensor(slots_of(pages, num_cached, page_size))]
        assert torch.equal(got, kv_rows(probe.token_ids, range(num_cached)))
    pool.allocator.decref(pages)
    cache.release(probe)
    cache.flush()
    assert pool.allocator.num_free == num_pages, "pages leaked"
