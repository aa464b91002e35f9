"""Drafter contract and the prompt-lookup drafter.

A drafter proposes up to k tokens to follow a request's current tokens, with a confidence per position (its
estimate that the target accepts that token, given the ones before were accepted). Drafts are either
deterministic given the request's tokens (`probs` None: the draft distribution q is a point mass) or drawn
from a distribution it reports (`probs[i]` = q at position i), which exact verification needs.

Model drafters (MTP) also see every forward of the target through `observe`, where they keep their own KV up
to date and prepare the next proposals; request-local drafters (prompt lookup) compute them in `propose`.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_rt.cache.kv_pool import KVLayout
from deepinfer_rt.request import Req


@dataclass
class Proposal:
    tokens: list[int]
    confidences: list[float]
    """Per position, the estimated probability that the target accepts it (given all before accepted)."""
    probs: torch.Tensor | None = None
    """(len(tokens), vocab) draft distributions the tokens were sampled from; None for deterministic drafts."""
    num_tokens: int = 0
    """req.num_tokens the proposal continues (a stale proposal is never verified)."""

    def truncate(self, k: int) -> Proposal:
        probs = None if self.probs is None else self.probs[:k]
        return Proposal(self.tokens[:k], self.confidences[:k], probs, self.num_tokens)


class Drafter:
    num_kv_layers: int = 0
    """Extra pool layers the drafter's own attention needs (slot j holds its KV of position j)."""

    def kv_layout(self, layout: KVLayout) -> KVLayout:
        """The target's pool layout plus the drafter's layers (same width as the target's by default)."""
        return dataclasses.replace(layout, num_layers=layout.num_layers + self.num_kv_layers)

    def propose(self, req: Req, k: int) -> Proposal | None:
        """Up to k tokens to follow req.token_ids, or None."""
        raise NotImplementedError

    def observe(self, runner, batch, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        """After a target forward: hidden (T, H) rows of `batch`; emitted[i] = tokens item i produced."""


class PromptLookupDrafter(Drafter):
    """Finds the latest earlier occurrence of the request's last n tokens (longest n first) and proposes the
    tokens that followed it. Confidence per position is the request's own acceptance rate so far (Beta(1, 1)
    prior): copying either keeps going or stops, and past behaviour is the best cheap predictor."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, req: Req, k: int) -> Proposal | None:
        index = req.draft_index
        if index is None or index.min_ngram != self.min_ngram or index.max_ngram != self.max_ngram:
            index = req.draft_index = NgramIndex(self.min_ngram, self.max_ngram)
        tokens = index.continuation(req.token_ids, k)
        if not tokens:
            return None
        rate = (req.num_accepted_tokens + 1) / (req.num_draft_tokens + 2)
        return Proposal(tokens, [rate] * len(tokens), None, req.num_tokens)

    def continuation(self, token_ids: list[int], k: int) -> list[int]:
        return find_continuation(token_ids, k, self.min_ngram, self.max_ngram)


class NgramIndex:
    """One request's n-grams, indexed as its tokens arrive: `continuation` equals find_continuation over the
    same tokens, with work per call proportional to the tokens added since the last call (times the n-gram
    lengths), never to the context (a numpy scan of a 32K-token context every step is O(context) host work).

    starts[n][gram] lists, ascending, each start s of an occurrence of `gram` (n tokens) that ends before the
    last token (s + n <= len(tokens) - 1): the candidate matches of the suffix n-gram."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.num_indexed = 0
        """Tokens covered: every n-gram ending within token_ids[:num_indexed] is listed."""

    def _extend(self, token_ids: list[int], end: int) -> None:
        for e in range(self.num_indexed + 1, end + 1):  # n-grams ending at position e - 1
            for n, starts in self.starts.items():
                if e >= n:
                    starts.setdefault(tuple(token_ids[e - n : e]), []).append(e - n)
        self.num_indexed = max(self.num_indexed, end)

    def continuation(self, token_ids: list[int], k: int) -> list[int]:
        num = len(token_ids)
        if num < self.num_indexed:  # the list was replaced by a shorter one: index it again
            self.starts = {n: {} for n in self.starts}
            self.num_indexed = 0
        if num < 2 or k <= 0:
            return []
        self._extend(token_ids, num - 1)
        for n in range(min(self.max_ngram, num - 1), self.min_ngram - 1, -1):
            starts = self.starts[n].get(tuple(token_ids[num - n :]))
            if starts:
                # The latest match with k tokens after it (s + n + k <= num), else the latest match.
                i = bisect.bisect_right(starts, num - n - k)
                start = (starts[i - 1] if i else starts[-1]) + n
                return token_ids[start : start + k]
        return []


def find_continuation(token_ids: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the last n tokens (n from max_ngram down)."""
    num = len(token_ids)
    if num < 2 or k <= 0:
        return []
    seq = np.asarray(token_ids, dtype=np.int64)
    # Candidate match ends: earlier positions holding the last token (the match must end before num - 1).
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    for n in range(min(max_ngram, num - 1), min_ngram - 1, -1):
        ok = ends[ends >= n - 1]
        for back in range(1, n):
            ok = ok[seq[ok - back] == seq[-1 - back]]
        if ok.size:
            # The latest match with k tokens after it, else the latest match.
            full = ok[ok + k < num]
            start = int(full[-1] if full.size else ok[-1]) + 1
            return token_ids[start : start + k]
    return []
