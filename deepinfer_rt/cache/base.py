"""Prefix cache contract, and the no-op cache used when the prefix cache is off.

Ownership: a page is referenced by every holder (each request whose `pages` list has it, and the tree for the
pages its nodes own), so freeing is always a decref. A request that reuses a cached prefix takes its own
references on those pages and locks the tree path (locked nodes are not evicted: evicting them would free
nothing while the request still reads them).
"""
from __future__ import annotations

from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.request import Req


class PrefixCache:
    enabled = False
    """Whether matches can ever hit (the scheduler skips prefix-sharing work otherwise)."""

    def match(self, req: Req) -> tuple[list[int], int]:
        """Longest cached, page-aligned prefix of req.token_ids, shorter than the whole sequence.

        Returns (pages, num_tokens): the caller owns new references to `pages`. Locks the matched path on
        behalf of `req` (released by `release`)."""
        return [], 0

    def peek(self, req: Req) -> int:
        """Length `match` would return, without locking or taking references (for scheduling order)."""
        return 0

    def insert(self, req: Req, num_tokens: int) -> None:
        """Offer req.token_ids[:num_tokens] (KV computed, in req.pages) to the cache."""

    def release(self, req: Req) -> None:
        """Unlock the path locked for req (at finish or retraction)."""

    def evict(self, num_pages: int) -> int:
        """Drop up to `num_pages` cached pages no request holds; returns pages freed."""
        return 0

    def flush(self) -> None:
        """Drop everything cached that no running request holds."""

    @property
    def num_cached_pages(self) -> int:
        return 0


class NoPrefixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
