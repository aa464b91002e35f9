"""DSpark under the EP worker pool (CPU, gloo; tiny V4.1 'a' with DSpark stages), beside test_ep_dspark.py:
chunked prefill with retraction, and batch-invariant mode at EP=2."""
from __future__ import annotations

import pytest

from test_ep_dspark import FIXED, GREEDY_ROWS, _run

pytestmark = pytest.mark.usefixtures("single_thread")



@pytest.fixture(scope="module")
def plain(dspark_v41_path):
    """Tokens without speculation, in process."""
    return _run(dspark_v41_path)[0]


def test_dspark_under_ep_with_chunked_prefill_and_retraction(dspark_v41_path, plain):
    """A KV budget per rank too small for its requests at once: requests are retracted and recomputed (their context
    keys rewritten by the recompute), prompts come in 7-token chunks; greedy tokens stay those of no speculation (=
    in-process DSpark's). Counts are not compared: a recompute's first token is sampled
    from the prefill, not verified, so they follow where the retractions fall."""
    kwargs = dict(kv_cache_tokens=40, chunked_prefill_tokens=7, page_size=4, max_num_seqs=4)
    tokens, stats, served = _run(dspark_v41_path, FIXED, ep_size=2, **kwargs)
    assert [tokens[i] for i in GREEDY_ROWS] == [plain[i] for i in GREEDY_ROWS]
    assert stats["num_retractions"] > 0 and stats["drafted"] > 0 and all(served), (stats, served)


def test_dspark_batch_invariant_under_ep_equals_in_process(dspark_v41_path, monkeypatch):
    """Batch-invariant mode (bf16, fixed-length drafts): EP=2's tokens and counts are the in-process engine's,
    the sampled request's too (its acceptance reads the drafter's probabilities bit for bit)."""
    monkeypatch.setenv("DEEPINFER_EP_STEP_TIMEOUT", "180")  # the batch-invariant CPU kernels are slow
    kwargs = dict(dtype="bfloat16", batch_invariant=True)
    expected = _run(dspark_v41_path, "dspark", **kwargs)
    assert 0 < expected[1]["accepted"] < expected[1]["drafted"], expected[1]
    tokens, stats, served = _run(dspark_v41_path, "dspark", ep_size=2, **kwargs)
    assert (tokens, stats) == expected[:2]
    assert all(served), served
