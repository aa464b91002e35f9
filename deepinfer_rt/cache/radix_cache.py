"""RadixAttention prefix cache: a radix tree over token ids whose nodes own the KV pages of their tokens.

Every key is page-aligned (a node's key length is a multiple of page_size), so a node's tokens are exactly
its pages' slots and a path from the root spells a prefix whose KV is the concatenation of the pages along it.
Children are keyed by their first page of tokens: siblings always differ within it, because the tree only
ever shares whole pages.

The tree holds one reference on each page a node owns (see base.py). A request that matched or inserted a
prefix locks the path from its node to the root (lock_ref counts such requests on a node and on all its
ancestors), so eviction only ever takes unlocked leaves: their KV is read by no running request.
"""
from __future__ import annotations

import heapq
import itertools

from deepinfer_rt.cache.base import PrefixCache
from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.request import Req


class TreeNode:
    __slots__ = ("id", "parent", "children", "key", "pages", "lock_ref", "last_access")

    def __init__(self, node_id: int, parent: "TreeNode | None", key: tuple[int, ...], pages: list[int],
                 last_access: int):
        self.id = node_id
        """Creation order; breaks LRU ties deterministically."""
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = last_access


class RadixCache(PrefixCache):
    enabled = True

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._ids = itertools.count()
        self._clock = 0
        """Logical time of the last access; a counter rather than wall time so eviction order is reproducible."""
        self.root = TreeNode(next(self._ids), None, (), [], 0)
        self._num_cached_pages = 0
        self.num_hit_tokens = 0
        self.num_query_tokens = 0
        self.num_evicted_pages = 0
        """Pages evict() took out of the tree (freed, or left to the requests still holding them)."""
        self.num_compared_tokens = 0
        """Tokens of requests compared with node keys so far (a counter the host-work tests read)."""
        self._peeked: dict[int, tuple[int, int]] = {}
        """rid -> (num_tokens, peek length) since the tree last changed its spelling (a node added or removed;
        splits spell the same prefixes): waiting requests are ordered every step, re-walking each prompt would
        be O(prompt) per waiting request per step."""

    # ---- contract ----
    def match(self, req: Req) -> tuple[list[int], int]:
        # A stale lock from an earlier admission would pin its path forever; start from a clean slate.
        self.release(req)
        # The last token is always computed: its logits give the next token.
        limit = self._restorable_limit(req)
        node, num_matched, pages = self._walk(req.token_ids, limit, self.root, 0, split=True)
        self.num_query_tokens += req.num_tokens
        self.num_hit_tokens += num_matched
        if node is self.root:
            return [], 0
        self.allocator.incref(pages)
        if self.allocator.prefix_guard is not None:
            self.allocator.prefix_guard.keep(pages, num_matched)
        self._touch(node)
        self._lock(node)
        req.cache_node, req.num_locked_tokens = node, num_matched
        return pages, num_matched

    def peek(self, req: Req) -> int:
        if self.allocator.prefix_guard is not None:  # the guard's state moves without the tree: no memo
            return self._walk(req.token_ids, self._restorable_limit(req), self.root, 0, split=False)[1]
        memo = self._peeked.get(req.rid)
        if memo is not None and memo[0] == req.num_tokens:
            return memo[1]
        num_matched = self._walk(req.token_ids, self._restorable_limit(req), self.root, 0, split=False)[1]
        self._peeked[req.rid] = (req.num_tokens, num_matched)
        return num_matched

    def _restorable_limit(self, req: Req) -> int:
        """Page-aligned bound of a match: the last token is always computed (its logits give the next token),
        and a pool with a prefix guard cuts the match back to where its state lets a sequence resume."""
        limit = (req.num_tokens - 1) // self.page_size * self.page_size
        guard = self.allocator.prefix_guard
        if guard is None:
            return limit
        _, num_matched, pages = self._walk(req.token_ids, limit, self.root, 0, split=False)
        return guard.restorable(pages, num_matched)

    def insert(self, req: Req, num_tokens: int) -> None:
        end = num_tokens // self.page_size * self.page_size
        # The locked node spells req.token_ids[:num_locked_tokens], so a chunked prefill's repeated inserts
        # only walk the newly computed part.
        if req.cache_node is not None:
            start_node, start = req.cache_node, req.num_locked_tokens
        else:
            start_node, start = self.root, 0
        if end <= start:
            return
        assert len(req.pages) * self.page_size >= end, "insert: req.pages do not cover the inserted tokens"
        node, pos, cached = self._walk(req.token_ids, end, start_node, start, split=True)
        if self.allocator.prefix_guard is not None:
            self.allocator.prefix_guard.adopt(cached, req.pages[start // self.page_size : pos // self.page_size])
        if pos < end:
            # Tokens already in the tree keep the tree's pages; the request's duplicates stay its own.
            leaf = TreeNode(next(self._ids), node, tuple(req.token_ids[pos:end]),
                            req.pages[pos // self.page_size : end // self.page_size], self._clock)
            self.allocator.incref(leaf.pages)
            node.children[leaf.key[: self.page_size]] = leaf
            self._num_cached_pages += len(leaf.pages)
            self._peeked.clear()
            node = leaf
        self._touch(node)
        self._lock(node)
        if req.cache_node is not None:
            self._unlock(req.cache_node)
        req.cache_node, req.num_locked_tokens = node, end

    def release(self, req: Req) -> None:
        self._peeked.pop(req.rid, None)
        if req.cache_node is not None:
            self._unlock(req.cache_node)
        req.cache_node, req.num_locked_tokens = None, 0

    def evict(self, num_pages: int) -> int:
        if num_pages <= 0:
            return 0
        free_before = self.allocator.num_free
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        # Pages an unlocked node shares with a request (e.g. an n > 1 sibling) are not freed by dropping it,
        # so progress is measured on the allocator, not on the pages dropped.
        while heap and self.allocator.num_free - free_before < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.num_evicted_pages += len(node.pages)
            self._remove_subtree(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return self.allocator.num_free - free_before

    def flush(self) -> None:
        # Locks cover whole paths to the root, so an unlocked node heads an entirely unlocked subtree.
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref == 0:
                    self._remove_subtree(child)
                else:
                    stack.append(child)

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached_pages

    def stats(self) -> dict:
        return {
            "num_cached_pages": self._num_cached_pages,
            "num_hit_tokens": self.num_hit_tokens,
            "num_query_tokens": self.num_query_tokens,
            "hit_rate": self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0,
            "num_evicted_pages": self.num_evicted_pages,
        }

    # ---- tree internals ----
    def _walk(self, token_ids: list[int], limit: int, node: TreeNode, pos: int, split: bool
              ) -> tuple[TreeNode, int, list[int]]:
        """Follow token_ids[pos:limit] down from `node` (which spells token_ids[:pos]); `limit` is page-aligned.

        Returns (deepest node reached, tokens matched, pages of the matched part below `node`). When the match
        ends inside a node, split=True splits it there so the returned node spells exactly the match; with
        split=False (peek) the tree is left alone and the returned node is the one above the partial match."""
        ps = self.page_size
        pages: list[int] = []
        while pos < limit:
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                break
            # At least the first page matches: it is the child's dict key.
            shared = self._shared_len(child.key, token_ids, pos, limit)
            if shared < len(child.key):
                if not split:
                    pages.extend(child.pages[: shared // ps])
                    pos += shared
                    break
                child = self._split(child, shared)
            pages.extend(child.pages)
            pos += shared
            node = child
        return node, pos, pages

    def _shared_len(self, key: tuple[int, ...], token_ids: list[int], pos: int, limit: int) -> int:
        """Length of the common prefix of `key` and token_ids[pos:limit], rounded down to whole pages."""
        n = min(len(key), limit - pos)
        self.num_compared_tokens += n
        if key[:n] == tuple(token_ids[pos : pos + n]):
            return n
        i = next(i for i in range(n) if key[i] != token_ids[pos + i])
        return i - i % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; returns the new upper part, which takes node's place under its parent.

        Page references move with the pages, and the upper part inherits node's locks and age: every lock
        and access of node went through it."""
        ps = self.page_size
        upper = TreeNode(next(self._ids), node.parent, node.key[:at], node.pages[: at // ps], node.last_access)
        upper.lock_ref = node.lock_ref
        node.parent.children[node.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // ps :], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        while node is not self.root:
            node.last_access = self._clock
            node = node.parent

    def _lock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def _unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            node = node.parent

    def _nodes(self):
        """Every node except the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _remove_subtree(self, top: TreeNode) -> None:
        """Detach `top` from its parent and drop the tree's references on every page below it."""
        del top.parent.children[top.key[: self.page_size]]
        self._peeked.clear()
        stack = [top]
        while stack:
            node = stack.pop()
            self.allocator.decref(node.pages)
            self._num_cached_pages -= len(node.pages)
            stack.extend(node.children.values())
