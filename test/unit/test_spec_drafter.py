"""Prompt lookup: the continuation of the latest earlier match of the longest suffix n-gram (vs a naive
search), the same from the request's incremental n-gram index, whose work per proposal does not grow with the
context, and confidences that follow the request's acceptance."""
from __future__ import annotations

import sys
import tracemalloc

import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.drafter import NgramIndex, PromptLookupDrafter, find_continuation


def naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            s = (full or starts)[-1]
            return tokens[s + n : s + n + k]
    return []


@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(1, 5), lo=st.integers(1, 2),
       extra=st.integers(0, 2))
def test_matches_naive_search(tokens, k, lo, extra):
    assert find_continuation(tokens, k, lo, lo + extra) == naive(tokens, k, lo, lo + extra)


def test_copies_an_input_span():
    prompt = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]
    assert find_continuation(prompt, 4, 1, 3) == [3, 4, 5, 6]


def test_confidence_follows_acceptance():
    drafter = PromptLookupDrafter()
    req = Req(0, [5, 6, 7, 5, 6], SamplingParams(), 0)
    first = drafter.propose(req, 3)
    assert first.tokens == [7, 5, 6] and first.confidences == [0.5] * 3
    req.num_draft_tokens, req.num_accepted_tokens = 3, 3
    assert drafter.propose(req, 3).confidences[0] > 0.5
    req.num_draft_tokens = 13
    assert drafter.propose(req, 3).confidences[0] < 0.5


@given(tokens=st.lists(st.integers(0, 4), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6),
       k=st.integers(1, 5), lo=st.integers(1, 2), extra=st.integers(0, 2))
def test_index_grown_step_by_step_matches_a_fresh_search(tokens, cuts, k, lo, extra):
    """The request's n-gram index, asked at growing lengths (a decode step adds one or several tokens), answers
    what a fresh search over the same tokens does."""
    index = NgramIndex(lo, lo + extra)
    for end in sorted(cuts) + [len(tokens)]:
        seen = tokens[:end]
        assert index.continuation(seen, k) == find_continuation(seen, k, lo, lo + extra)


def _propose_work(context: int) -> tuple[int, int]:
    """(Python lines of deepinfer_rt run, peak bytes of Python allocations) of one proposal after a token was
    added to a request of `context` tokens that has proposed before."""
    tokens = torch.randint(0, 50, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    drafter = PromptLookupDrafter()
    req = Req(0, tokens, SamplingParams(), 0)
    drafter.propose(req, 5)
    req.token_ids.append(7)
    lines = [0]

    def tracer(frame, event, arg):
        if "deepinfer_rt" not in frame.f_code.co_filename:
            return None
        lines[0] += event == "line"
        return tracer

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sys.settrace(tracer)
    try:
        drafter.propose(req, 5)
    finally:
        sys.settrace(None)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    return lines[0], peak


def test_a_proposal_does_not_grow_with_the_context():
    """256 vs 32K tokens: about the same lines (which n-gram length matches differs), and no allocation the size
    of the context (32K int64s are 256 KB)."""
    (lines_short, peak_short), (lines_long, peak_long) = _propose_work(256), _propose_work(32768)
    assert lines_long <= lines_short + 12, (lines_short, lines_long)
    assert peak_long <= peak_short + 4096, (peak_short, peak_long)
