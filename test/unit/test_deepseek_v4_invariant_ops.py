"""models/deepseek_v4/invariant.py: the blockwise attention and indexer scores equal the plain formulas (over several key
blocks) and give a query the same bits whatever other queries share the call."""
from __future__ import annotations

import torch

from deepinfer_rt.models.deepseek_v4 import invariant as v4_invariant
from deepinfer_rt.models.deepseek_v4.invariant import KEY_BLOCK


def _reference_attend(q, keys, valid, scale, sink):
    scores = torch.einsum("nhd,nld->nhl", q.double(), keys.double()) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat([scores, sink.double().view(1, -1, 1).expand(len(q), -1, 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("nhl,nld->nhd", probs, keys.double())


def _case(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    length = 3 * KEY_BLOCK
    q, keys = torch.randn(n, 4, 16, generator=gen), torch.randn(n, length, 16, generator=gen)
    lens = torch.randint(1, length + 1, (n,), generator=gen)
    valid = (torch.arange(length) < lens[:, None]) & (torch.rand(n, length, generator=gen) < 0.8)
    valid[:, 0] = True
    return q, keys, valid, torch.randn(4, generator=gen)


def test_attend_matches_softmax_with_sink():
    q, keys, valid, sink = _case(9, 0)
    out = v4_invariant.attend(q, keys, valid, 0.25, sink)
    torch.testing.assert_close(out.double(), _reference_attend(q, keys, valid, 0.25, sink), rtol=1e-5, atol=1e-5)


def test_attend_and_index_scores_are_batch_invariant():
    q, keys, valid, sink = _case(70, 1)  # more rows than one fixed GEMM batch
    full = v4_invariant.attend(q, keys, valid, 0.25, sink)
    weights = torch.randn(70, 4, generator=torch.Generator().manual_seed(2))
    scores = v4_invariant.index_scores(q, keys, weights, 0.25)
    reference = (torch.einsum("nhd,ned->nhe", q.double(), keys.double()).relu() * 0.25
                 * weights.double()[..., None]).sum(1)
    torch.testing.assert_close(scores.double(), reference, rtol=1e-5, atol=1e-5)
    for i in (0, 33, 69):
        one = slice(i, i + 1)
        assert torch.equal(v4_invariant.attend(q[one], keys[one], valid[one], 0.25, sink), full[one])
        # A shorter key list (trailing whole blocks dropped) must not change the row either.
        short = int(valid[i].nonzero().max()) // KEY_BLOCK * KEY_BLOCK + KEY_BLOCK
        assert torch.equal(v4_invariant.attend(q[one], keys[one, :short], valid[one, :short], 0.25, sink), full[one])
        assert torch.equal(v4_invariant.index_scores(q[one], keys[one], weights[one], 0.25), scores[one])


def test_top_k_mask_breaks_ties_by_index():
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]])
    visible = torch.tensor([[True, True, False, True, True]])
    chosen = v4_invariant.top_k_mask(scores, visible, 3)
    assert chosen.tolist() == [[True, True, False, False, True]]
    assert v4_invariant.top_k_mask(scores, visible, 9).tolist() == visible.tolist()
