"""Sampler on CPU: seeded Gumbel draws — independent of batch composition and order, reproducible per seed and
position, and distributed as the filtered softmax (chi-square over many seeds)."""
from __future__ import annotations

import pytest
import torch
from sampler_helpers import EOS, V, make_req

from deepinfer_rt.request import Req
from deepinfer_rt.sampler import Sampler, stream_seed, stream_seeds, uniform_noise


def _mixed_batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, list[Req]]:
    logits = torch.randn(n, V, generator=g) * 2
    settings_ = [dict(), dict(temperature=0.5), dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2),
                 dict(temperature=0.0), dict(temperature=1.7, top_k=5, top_p=0.9)]
    reqs = [make_req(i, output=[1] * (i % 4), seed=1000 + 7 * i, **settings_[i % len(settings_)])
            for i in range(n)]
    return logits, reqs


def test_seeded_draw_independent_of_batch_composition_and_order():
    g = torch.Generator().manual_seed(5)
    logits, reqs = _mixed_batch(g, 14)
    sampler = Sampler(V)
    full = sampler(logits.clone(), reqs, (EOS,)).token_ids
    for i, r in enumerate(reqs):
        assert sampler(logits[i : i + 1].clone(), [r], (EOS,)).token_ids == [full[i]]
    perm = torch.randperm(len(reqs), generator=g).tolist()
    permuted = sampler(logits[perm].clone(), [reqs[j] for j in perm], (EOS,)).token_ids
    assert permuted == [full[j] for j in perm]
    # and a subset
    sub = [0, 3, 4, 9]
    assert sampler(logits[sub].clone(), [reqs[j] for j in sub], (EOS,)).token_ids == [full[j] for j in sub]


def test_seeded_draw_depends_on_seed_position_only():
    logits = torch.zeros(1, V)
    sampler = Sampler(V)
    a = make_req(0, prompt=[1, 2, 3], output=[4, 4], seed=42)
    b = make_req(99, prompt=[6], output=[0, 1], seed=42)  # other rid / prompt / history, same position
    assert sampler(logits, [a], (EOS,)).token_ids == sampler(logits, [b], (EOS,)).token_ids
    # the noise itself is a pure function of (seed, position)
    assert torch.equal(uniform_noise(42, 2, V, torch.device("cpu")), uniform_noise(42, 2, V, torch.device("cpu")))
    assert not torch.equal(uniform_noise(42, 2, V, torch.device("cpu")), uniform_noise(42, 3, V, torch.device("cpu")))
    assert not torch.equal(uniform_noise(42, 2, V, torch.device("cpu")), uniform_noise(43, 2, V, torch.device("cpu")))


def _generate(seed: int, steps: int, logits: torch.Tensor, **params) -> list[int]:
    req = make_req(seed=seed, **params)
    sampler = Sampler(V)
    for _ in range(steps):
        req.token_ids.append(sampler(logits.clone(), [req], (EOS,)).token_ids[0])
    return req.output_ids


def test_seeded_sequences_reproducible_and_distinct_across_seeds():
    logits = torch.zeros(1, V)
    seqs = [tuple(_generate(s, 16, logits)) for s in range(20)]
    assert seqs == [tuple(_generate(s, 16, logits)) for s in range(20)]
    assert len(set(seqs)) == len(seqs)
    assert all(len(set(s)) > 1 for s in seqs)  # the position advances the stream


def test_stream_seed_mixes_seed_and_position():
    values = {stream_seed(s, p) for s in range(50) for p in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**63 for v in values)
    seeds = [0, 1, 2**63 - 1, 2**64 - 5, -3, 123456789] * 3
    positions = [0, 7, 2**40, 5, 1, -2, 3, 3, 3, 0, 0, 0, 9, 8, 7, 6, 5, 4]
    assert stream_seeds(seeds, positions).tolist() == [stream_seed(s, p) for s, p in zip(seeds, positions)]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    mask = probs > 0
    exp = probs[mask] * n
    return float(((counts[mask] - exp) ** 2 / exp).sum())


N_DRAWS = 20_000
# chi-square, 7 degrees of freedom: P(X > 35) ~ 1e-5. The seeds are fixed, so the statistic is deterministic.
CHI2_LIMIT = 35.0


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_gumbel_draw_matches_softmax_over_seeds(temperature):
    base = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0, 0.4, -0.3])
    reqs = [make_req(i, seed=i, temperature=temperature) for i in range(N_DRAWS)]
    tokens = Sampler(V)(base.expand(N_DRAWS, V).contiguous(), reqs, (EOS,)).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    probs = (base.double() / temperature).softmax(-1)
    assert _chi_square(counts, probs) < CHI2_LIMIT
    # power check: the statistic clearly rejects the distribution at the wrong temperature
    wrong = (base.double() / (temperature * 1.5)).softmax(-1)
    assert _chi_square(counts, wrong) > 3 * CHI2_LIMIT


def test_gumbel_draw_over_positions_matches_softmax():
    base = torch.tensor([0.5, -0.2, 1.3, 0.0, -1.0, 0.9, 0.1, -0.6])
    reqs = [make_req(i, output=[0] * i, seed=12345) for i in range(2000)]  # one seed, many positions
    tokens = Sampler(V)(base.expand(len(reqs), V).contiguous(), reqs, (EOS,)).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    assert _chi_square(counts, base.double().softmax(-1)) < CHI2_LIMIT


def test_gumbel_draw_with_top_k_matches_renormalised_softmax():
    base = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0, 0.4, -0.3])
    t = 0.8
    reqs = [make_req(i, seed=10_000 + i, temperature=t, top_k=3) for i in range(N_DRAWS // 2)]
    tokens = Sampler(V)(base.expand(len(reqs), V).contiguous(), reqs, (EOS,)).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    allowed = torch.tensor([0, 3, 6])
    assert set(tokens) <= set(allowed.tolist())
    probs = torch.zeros(V, dtype=torch.float64)
    probs[allowed] = (base.double()[allowed] / t).softmax(-1)
    # 2 degrees of freedom: P(X > 25) ~ 4e-6
    assert _chi_square(counts, probs) < 25.0
