"""Prompt lookup: the continuation of the latest earlier match of the longest suffix n-gram (vs a naive
search), and confidences that follow the request's acceptance."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.drafter import PromptLookupDrafter, find_continuation


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
