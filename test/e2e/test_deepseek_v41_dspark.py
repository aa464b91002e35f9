"""DeepSeek-V4.1's DSpark drafter (speculative="dspark") on the tiny config 'a' with DSpark weights: its block
forward equals the plain reference (test/reference/deepseek_v41_ref.py DSparkReference) on the target features the
engine captured; greedy outputs with the drafter equal those without (also with 7-token chunks and 4-token pages,
and in bf16, where the drafter keeps fp32 what the target does); with a head that knows the target's continuation
every draft is accepted; sampled outputs keep the target's distribution (chi-square, as test_speculative.py's
check); acceptance statistics are reported.

The reference checks run on a 48-token vocabulary (the same config otherwise): the oracle's compressed vocabulary
is then built from 48 token texts, not 20,000, and one oracle serves the block forward and the distribution."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig
from deepinfer_rt.speculative.dspark import DSparkDrafter, survival_to_confidences
from deepinfer_rt.speculative.stats import spec_stats

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test" / "reference"))
sys.path.insert(0, str(ROOT / "test" / "e2e"))

pytestmark = pytest.mark.usefixtures("single_thread")


def _ids(seed: int, n: int, high: int = 20000) -> list[int]:
    return torch.randint(100 if high > 200 else 3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(i, n) for i, n in enumerate((1, 6, 13, 29))]
GREEDY = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)
VOCAB = 48
SMALL_PROMPTS = [_ids(10 + i, n, high=VOCAB) for i, n in enumerate((1, 6, 13, 29))]


@pytest.fixture(scope="module")
def dspark_path(dspark_v41_path):
    return dspark_v41_path


@pytest.fixture(scope="module")
def small_vocab_path(tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v41", tmp_path_factory.mktemp("tiny-v41-dspark-v48"), seed=2, variant="a",
                                dspark=True, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def small_reference(small_vocab_path):
    """The plain target forward (V41Reference) on the 48-token checkpoint."""
    from deepseek_v41_ref import V41Reference
    from transformers import AutoTokenizer

    text = json.loads((small_vocab_path / "config.json").read_text())["text_config"]
    tok = AutoTokenizer.from_pretrained(small_vocab_path)
    texts, raw = tok.batch_decode([[i] for i in range(VOCAB)]), tok.convert_ids_to_tokens(list(range(VOCAB)))
    return V41Reference(text, load_file(small_vocab_path / "model.safetensors"), texts, raw_tokens=raw)


def _generate(path, prompts, params, dtype="float32", **kwargs):
    with Engine(str(path), dtype=dtype, kv_cache_tokens=2048, **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.stats.get("spec")
    assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], stats


@pytest.fixture(scope="module")
def plain(dspark_path):
    return _generate(dspark_path, PROMPTS, GREEDY)[0]


def test_block_forward_matches_reference(small_vocab_path, small_reference):
    """Blocks the engine drafted (after prefills and after verification steps; the first two and the last of each
    prompt) against the plain forward."""
    from deepseek_v41_ref import DSparkReference

    seen = []
    draft, pick = DSparkDrafter._draft, DSparkDrafter._pick

    def record_draft(self, runner, ends):
        rows = []
        mp.setattr(DSparkDrafter, "_pick", staticmethod(
            lambda logits, reqs, row: (rows.append(logits.clone()), pick(logits, reqs, row))[1]))
        out = draft(self, runner, ends)
        for j, end in enumerate(ends):
            seen.append((end.seq, out[end.req.rid], torch.stack([r[j] for r in rows])))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DSparkDrafter, "_draft", record_draft)
        _generate(small_vocab_path, SMALL_PROMPTS, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
                  speculative="dspark")
    by_prompt = {}
    for item in seen:
        by_prompt.setdefault(next(i for i, p in enumerate(SMALL_PROMPTS) if item[0][: len(p)] == p), []).append(item)
    assert sorted(by_prompt) == [0, 1, 2, 3] and all(len(v) >= 3 for v in by_prompt.values())
    reference = DSparkReference(small_reference)
    for items in by_prompt.values():
        for seq, proposal, logits in items[:2] + items[-1:]:
            tokens, ref_logits, survival = reference.draft(seq[:-1], seq[-1])
            assert proposal.tokens == tokens
            torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(proposal.confidences), torch.tensor(
                survival_to_confidences(survival.tolist())), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def dspark_engine(dspark_path):
    """The drafter on config 'a' (confidence-scheduled verification), shared by the greedy and forced runs."""
    with Engine(str(dspark_path), dtype="float32", kv_cache_tokens=2048, speculative="dspark") as engine:
        yield engine


def _spec_counts(engine: Engine) -> tuple[int, int, int]:
    return engine.spec.num_drafted, engine.spec.num_accepted, engine.spec.num_verify_steps


def test_greedy_identical_with_drafter(dspark_path, dspark_engine, plain):
    before = _spec_counts(dspark_engine)
    outs = dspark_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    stats = spec_stats(*(n - m for n, m in zip(_spec_counts(dspark_engine), before)))
    assert [o.token_ids for o in outs] == plain
    assert stats["drafted"] > 0 and 0.0 <= stats["acceptance_rate"] <= 1.0, stats  # a random drafter accepts little
    print("DSpark, random tiny drafter:", stats)
    got, _ = _generate(dspark_path, PROMPTS, GREEDY, speculative="dspark", chunked_prefill_tokens=7, page_size=4)
    assert got == plain


class OracleHead(DSparkDrafter):
    """The drafter with its rows' logits replaced by a one-hot of the target's greedy continuation (known from the
    run without drafts): the block's alignment, verification and accounting are then what is tested."""

    continuations: dict[tuple[int, ...], list[int]] = {}

    def _draft(self, runner, ends):
        self._seqs = [e.seq for e in ends]
        return super()._draft(runner, ends)

    def _pick(self, logits, reqs, row):
        tokens = [self.continuations[tuple(seq)][row] for seq in self._seqs]
        forced = torch.full_like(logits, -1e9)
        forced[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
        return DSparkDrafter._pick(forced, reqs, row)


def test_forced_acceptance(dspark_engine, plain):
    """Every draft verified (fixed length) and accepted; the module's drafter engine, its class swapped for the run
    (the prompts may hit the prefix cache of the greedy run: the drafter's context keys come back with it)."""
    cont = {}
    for prompt, out in zip(PROMPTS, plain):
        full = prompt + out + [0] * 8
        for n in range(len(prompt) + 1, len(prompt) + len(out) + 1):
            cont[tuple(full[:n])] = full[n : n + 8]
    OracleHead.continuations = cont
    spec = dspark_engine.spec
    before, was_fixed = _spec_counts(dspark_engine), spec.fixed_length
    spec.fixed_length, spec.drafter.__class__ = True, OracleHead
    try:
        outs = dspark_engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        spec.fixed_length, spec.drafter.__class__ = was_fixed, DSparkDrafter
    stats = spec_stats(*(n - m for n, m in zip(_spec_counts(dspark_engine), before)))
    assert [o.token_ids for o in outs] == plain
    print("DSpark, oracle head:", stats)
    assert stats["drafted"] > 0 and stats["acceptance_rate"] == 1.0, stats
    assert stats["mean_accepted_length"] >= 2.0, stats  # blocks of 3, cut only by max_new_tokens


def test_refused_without_dspark_weights(dspark_path, tmp_path):
    """The same checkpoint declaring no DSpark layers (its other files linked)."""
    for f in dspark_path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((dspark_path / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DSpark"):
        Engine(str(tmp_path), dtype="float32", kv_cache_tokens=512, speculative="dspark")


def test_bf16_greedy_identical_and_fp32_kept(dspark_path):
    """In bf16 the drafter keeps fp32 exactly the parameter kinds the target keeps fp32 (norm gains, sinks, mHC
    weights, the router's correction bias), and greedy outputs with it equal those without."""
    prompts = PROMPTS[1:3]
    plain_bf16, _ = _generate(dspark_path, prompts, GREEDY, dtype="bfloat16")
    with Engine(str(dspark_path), dtype="bfloat16", kv_cache_tokens=2048, speculative="dspark") as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        stats = engine.stats["spec"]
        target = {re.sub(r"^model\.layers\.\d+\.", "", n): p.dtype for n, p in engine.model.named_parameters()}
        draft = {re.sub(r"^stages\.\d+\.", "", n): p.dtype for n, p in engine.spec.drafter.net.named_parameters()}
    assert [o.token_ids for o in outs] == plain_bf16
    assert stats["drafted"] > 0, stats
    shared = sorted(set(target) & set(draft))
    assert len(shared) >= 15, shared  # attention, norms, mHC, router, experts
    assert {n: draft[n] for n in shared} == {n: target[n] for n in shared}
    fp32 = {n for n, d in draft.items() if d == torch.float32}
    assert {"attn_norm.weight", "ffn_norm.weight", "attn.q_norm.weight", "attn.kv_norm.weight", "attn.attn_sink",
            "hc_attn.fn", "hc_ffn.base", "ffn.gate.bias", "main_norm.weight", "norm.weight"} <= fp32, fp32
    assert draft["attn.wq_a.weight"] == draft["ffn.experts.gate_up_proj"] == torch.bfloat16


def test_sampling_distribution_is_exact(small_vocab_path, small_reference):
    """Token 0 comes from the prefill, token 1 from the verification of the drafter's sampled drafts (accepted, or
    replaced after a rejection): both follow the target's exact distributions (the oracle's)."""
    from test_speculative import chi_square_pvalue

    ref = small_reference
    prompt, temperature, num = [3, 14, 15, 9, 26, 5], 0.8, 300
    p1 = (ref.logits(prompt)[-1] / temperature).softmax(-1)
    p2 = torch.stack([(ref.logits(prompt + [a])[-1] / temperature).softmax(-1) for a in range(VOCAB)])
    marginals = [p1, (p1[:, None] * p2).sum(0)]
    alpha = 1e-3
    assert _power(marginals[1], marginals[0], num, alpha) > 0.9999  # num draws can tell token 1's law from token 0's
    params = [SamplingParams(max_new_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(num)]
    with Engine(str(small_vocab_path), dtype="float32", kv_cache_tokens=16384, max_num_seqs=1024,
                speculative=SpeculativeConfig(method="dspark", max_draft=1, fixed_length=True)) as e:
        outs = e.generate(input_ids=[prompt] * num, sampling_params=params)
        stats = e.stats["spec"]
    print("DSpark, sampled:", stats)
    assert stats["drafted"] >= num and 0.0 < stats["acceptance_rate"] < 1.0, stats
    for j, probs in enumerate(marginals):
        counts = torch.bincount(torch.tensor([o.token_ids[j] for o in outs]), minlength=VOCAB)
        assert chi_square_pvalue(counts, probs) > alpha, j
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=VOCAB)
    assert chi_square_pvalue(counts, marginals[0]) < alpha  # the check has power


def _power(actual: torch.Tensor, claimed: torch.Tensor, num: int, alpha: float) -> float:
    """The chance that a chi-square test at level alpha rejects `claimed` on num draws from `actual` (noncentral
    chi-square, all cells; pooling the small cells, as chi_square_pvalue does, only adds power)."""
    from scipy.stats import chi2, ncx2

    dof = actual.numel() - 1
    noncentrality = num * float(((actual.double() - claimed.double()) ** 2 / claimed.double()).sum())
    return float(ncx2.sf(chi2.isf(alpha, dof), dof, noncentrality))
