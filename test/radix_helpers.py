"""Radix-cache test fixtures: fake requests with real pages from a PageAllocator, and `PageLedger`, which remembers
which token prefix each page's KV was computed for, so a match can be checked to hand back the KV of exactly the
tokens it claims (test/unit/test_radix_cache*.py)."""
from __future__ import annotations

import itertools

from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.cache.radix_cache import RadixCache, TreeNode
from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams

_rids = itertools.count()


def make_req(tokens) -> Req:
    return Req(next(_rids), list(tokens), SamplingParams(), seed=0)


class PageLedger:
    """What each page's KV was computed for: the token prefix ending at the page's last written slot (a
    position's KV depends on every token before it). Updated only by simulated forward passes."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.content: dict[int, tuple[int, ...]] = {}

    def pages_needed(self, req: Req, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) - len(req.pages)

    def compute(self, req: Req, num_tokens: int) -> bool:
        """Give req pages covering num_tokens and write the KV of its uncomputed positions below num_tokens;
        False (and nothing changes) when the pool is short."""
        need = self.pages_needed(req, num_tokens)
        if need > 0:
            pages = self.allocator.alloc(need)
            if pages is None:
                return False
            req.pages.extend(pages)
        ps = self.page_size
        for i in range(req.num_computed_tokens // ps, -(-num_tokens // ps)):
            self.content[req.pages[i]] = tuple(req.token_ids[: min((i + 1) * ps, num_tokens)])
        req.num_computed_tokens = max(req.num_computed_tokens, num_tokens)
        return True

    def check_match(self, req: Req, pages: list[int], num_tokens: int) -> None:
        assert num_tokens % self.page_size == 0 and num_tokens < req.num_tokens
        assert len(pages) * self.page_size == num_tokens
        for i, page in enumerate(pages):
            assert self.content[page] == tuple(req.token_ids[: (i + 1) * self.page_size]), \
                f"page {page} holds KV of other tokens"


def tree_nodes(cache: RadixCache) -> list[tuple[TreeNode, tuple[int, ...]]]:
    """(node, the token prefix its path spells) for every node below the root."""
    out, stack = [], [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            out.append((child, path + child.key))
            stack.append((child, path + child.key))
    return out


def tree_pages(cache: RadixCache) -> list[int]:
    return [p for node, _ in tree_nodes(cache) for p in node.pages]


def finish(cache: RadixCache, allocator: PageAllocator, req: Req) -> None:
    """The scheduler's order at finish: offer the computed tokens, unlock, then drop the request's pages."""
    cache.insert(req, req.num_computed_tokens)
    cache.release(req)
    allocator.decref(req.pages)
    req.pages = []


def run_prompt(cache: RadixCache, ledger: PageLedger, tokens) -> Req:
    """Admit, compute the whole prompt, and finish one request; returns it (its pages are released)."""
    req = make_req(tokens)
    req.pages, req.num_computed_tokens = cache.match(req)
    assert ledger.compute(req, req.num_tokens)
    finish(cache, ledger.allocator, req)
    return req


def setup(num_pages: int, page_size: int) -> tuple[PageAllocator, RadixCache, PageLedger]:
    allocator = PageAllocator(num_pages)
    return allocator, RadixCache(allocator, page_size), PageLedger(allocator, page_size)
