"""Verification rules on synthetic distributions: rejection sampling emits tokens distributed as the target
(chi-square at a fixed significance, seeded), point-mass drafts reproduce the plain sampler's tokens, greedy
accepts the longest matching prefix."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from deepinfer_rt.request import Req
from deepinfer_rt.sampler import Sampler
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.drafter import Proposal
from deepinfer_rt.speculative.verify import draft_rows, verify

V = 12
ALPHA = 1e-3


def make(seed: int, temperature: float = 1.0, num_out: int = 0) -> Req:
    req = Req(seed, [1, 2, 3], SamplingParams(temperature=temperature, max_new_tokens=64), seed)
    req.token_ids += [4] * num_out
    return req


def pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs * counts.sum() >= 5  # cells expected below 5 are pooled
    obs, exp = counts[keep].double(), probs[keep].double()
    if not keep.all():
        obs = torch.cat([obs, counts[~keep].sum(0, keepdim=True).double()])
        exp = torch.cat([exp, probs[~keep].sum(0, keepdim=True).double()])
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def test_rejection_sampling_emits_target_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 1.5  # target rows for positions 1..3 (two drafts + bonus)
    p = logits.softmax(-1)
    q = torch.rand(2, V, generator=gen).pow(3) + 1e-3  # a bad drafter: mass on the wrong tokens
    q /= q.sum(-1, keepdim=True)
    first, second, num = torch.zeros(V), torch.zeros(V), 2500
    num_accepted = 0
    for s in range(num):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        req = make(s)
        (out,) = verify(logits, draft_rows(req, drafts), [(req, Proposal(drafts, [0.5, 0.5], q, req.num_tokens))])
        first[out[0]] += 1
        num_accepted += len(out) - 1
        if len(out) > 1:  # the first draft was accepted: the next token follows row 1
            second[out[1]] += 1
    assert 0.1 * num < num_accepted < 1.5 * num  # rejections are frequent, acceptances too
    assert pvalue(first, p[0]) > ALPHA
    assert pvalue(second, p[1]) > ALPHA
    assert pvalue(first, q[0]) < ALPHA  # power: the draft distribution itself is rejected


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_point_mass_drafts_reproduce_the_sampler(temperature):
    """Drafts from a deterministic drafter: verification emits exactly the tokens the sampler would draw
    position by position, whatever the drafts were."""
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler(V)
    for s in range(40):
        logits = torch.randn(4, V, generator=gen)
        req = make(s, temperature, num_out=2)
        plain = []
        for j in range(4):
            plain.append(sampler(logits[j : j + 1], [make(s, temperature, num_out=2 + j)], ()).token_ids[0])
        drafts = [plain[0], plain[1], (plain[2] + 1) % V]  # accepted, accepted, rejected
        (out,) = verify(logits, draft_rows(req, drafts), [(req, Proposal(drafts, [1.0] * 3, None, 0))])
        assert out == plain[:3]


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, V), -1.0)
    for j, best in enumerate([5, 7, 2, 9]):
        logits[j, best] = 3.0
    req = make(0, temperature=0.0)
    cases = {(5, 7, 2): [5, 7, 2, 9], (5, 7, 3): [5, 7, 2], (6, 7, 2): [5], (5, 1, 2): [5, 7]}
    for drafts, expected in cases.items():
        (out,) = verify(logits, draft_rows(req, list(drafts)), [(req, Proposal(list(drafts), [1.0] * 3))])
        assert out == expected


def test_draft_rows_penalise_as_the_request_with_its_drafts_appended():
    """Row j's penalties are its request's device counts plus drafts[:j]: the same logits as a request whose
    tokens already hold them (repetition, frequency and presence alike), after the request's state was used."""
    from deepinfer_rt.sampler import apply_penalties

    params = SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    req = Req(0, [1, 2, 3], params, 0)
    req.token_ids += [4, 5]
    drafts = (5, 6, 6)
    logits = torch.randn(len(drafts) + 1, V, generator=torch.Generator().manual_seed(1))
    apply_penalties(logits[:1].clone(), [req])  # the request's own counts exist before verification
    got = logits.clone()
    apply_penalties(got, draft_rows(req, drafts))
    for j in range(len(drafts) + 1):
        plain = Req(1, [1, 2, 3], params, 0)
        plain.token_ids += [4, 5, *drafts[:j]]
        want = logits[j : j + 1].clone()
        apply_penalties(want, [plain])
        torch.testing.assert_close(got[j : j + 1], want, rtol=0, atol=0)
    assert req.penalty_state.num_tokens == 5  # the rows did not write their drafts into the request's counts
