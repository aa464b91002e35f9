"""Drafter contract and the prompt-lookup drafter.

A drafter proposes up to k tokens to follow a request's current tokens, with a confidence per position (its
estimate that the target accepts that token, given the ones before were accepted). Drafts are either
deterministic given the request's tokens (`probs` None: the draft distribution q is a point mass) or drawn
from a distribution it reports (`probs[i]` = q at position i), which exact verification needs.

Model drafters (MTP) also see every forward of the target through `observe`, where they keep their own KV up
to date and prepare the next proposals; request-local drafters (prompt lookup) compute them in `propose`.
"""
from __future__ import annotations

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
        tokens = self.continuation(req.token_ids, k)
        if not tokens:
            return None
        rate = (req.num_accepted_tokens + 1) / (req.num_draft_tokens + 2)
        return Proposal(tokens, [rate] * len(tokens), None, req.num_tokens)

    def continuation(self, token_ids: list[int], k: int) -> list[int]:
        return find_continuation(token_ids, k, self.min_ngram, self.max_ngram)


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
