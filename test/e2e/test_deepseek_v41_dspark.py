"""DeepSeek-V4.1's DSpark drafter (speculative="dspark") on the tiny config 'a' with DSpark weights: its block
forward equals the plain reference (test/reference/deepseek_v41_ref.py DSparkReference) on the target features the
engine captured; greedy outputs with the drafter equal those without (also with 7-token chunks and 4-token pages);
with a head that knows the target's continuation every draft is accepted; sampled outputs keep the target's
distribution (chi-square, as test_speculative.py's check); acceptance statistics are reported."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig
from deepinfer_rt.speculative.dspark import DSparkDrafter, survival_to_confidences

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test" / "reference"))
sys.path.insert(0, str(ROOT / "test" / "e2e"))

pytestmark = pytest.mark.usefixtures("single_thread")


def _ids(seed: int, n: int, high: int = 20000) -> list[int]:
    return torch.randint(100 if high > 200 else 3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(i, n) for i, n in enumerate((1, 6, 13, 29))]
GREEDY = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def dspark_path(tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v41", tmp_path_factory.mktemp("tiny-v41-dspark"), seed=0, variant="a",
                                dspark=True)


@pytest.fixture(scope="module")
def reference(dspark_path):
    from deepseek_v41_ref import DSparkReference, V41Reference
    from transformers import AutoTokenizer

    text = json.loads((dspark_path / "config.json").read_text())["text_config"]
    tok = AutoTokenizer.from_pretrained(dspark_path)
    ids = list(range(text["vocab_size"]))
    texts, raw = tok.batch_decode([[i] for i in ids]), tok.convert_ids_to_tokens(ids)
    return DSparkReference(V41Reference(text, load_file(dspark_path / "model.safetensors"), texts, raw_tokens=raw))


def _generate(path, prompts, params, **kwargs):
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.stats.get("spec")
    assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], stats


@pytest.fixture(scope="module")
def plain(dspark_path):
    return _generate(dspark_path, PROMPTS, GREEDY)[0]


def test_block_forward_matches_reference(dspark_path, reference, monkeypatch):
    """Every block the engine drafted (prefill ends and verification steps) against the plain forward."""
    seen = []
    draft, pick = DSparkDrafter._draft, DSparkDrafter._pick

    def record_draft(self, runner, ends):
        rows = []
        monkeypatch.setattr(DSparkDrafter, "_pick", staticmethod(
            lambda logits, reqs, row: (rows.append(logits.clone()), pick(logits, reqs, row))[1]))
        out = draft(self, runner, ends)
        for j, end in enumerate(ends):
            seen.append((end.seq, out[end.req.rid], torch.stack([r[j] for r in rows])))
        return out

    monkeypatch.setattr(DSparkDrafter, "_draft", record_draft)
    _generate(dspark_path, PROMPTS[1:], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
              speculative="dspark")
    assert len(seen) >= 6
    for seq, proposal, logits in seen:
        tokens, ref_logits, survival = reference.draft(seq[:-1], seq[-1])
        assert proposal.tokens == tokens
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(proposal.confidences), torch.tensor(
            survival_to_confidences(survival.tolist())), atol=1e-5, rtol=1e-5)


def test_greedy_identical_with_drafter(dspark_path, plain):
    got, stats = _generate(dspark_path, PROMPTS, GREEDY, speculative="dspark")
    assert got == plain
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


def test_forced_acceptance(dspark_path, plain):
    cont = {}
    for prompt, out in zip(PROMPTS, plain):
        full = prompt + out + [0] * 8
        for n in range(len(prompt) + 1, len(prompt) + len(out) + 1):
            cont[tuple(full[:n])] = full[n : n + 8]
    OracleHead.continuations = cont
    with Engine(str(dspark_path), dtype="float32", kv_cache_tokens=2048,
                speculative=SpeculativeConfig(method="dspark", fixed_length=True)) as engine:
        engine.spec.drafter.__class__ = OracleHead
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        stats = engine.stats["spec"]
    assert [o.token_ids for o in outs] == plain
    print("DSpark, oracle head:", stats)
    assert stats["drafted"] > 0 and stats["acceptance_rate"] == 1.0, stats
    assert stats["mean_accepted_length"] >= 2.0, stats  # blocks of 3, cut only by max_new_tokens


def test_refused_without_dspark_weights(tiny_v41_paths):
    with pytest.raises(ValueError, match="DSpark"):
        Engine(str(tiny_v41_paths["a"]), dtype="float32", kv_cache_tokens=512, speculative="dspark")


VOCAB = 48


@pytest.fixture(scope="module")
def small_vocab_path(tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v41", tmp_path_factory.mktemp("tiny-v41-dspark-v48"), seed=2, variant="a",
                                dspark=True, vocab_size=VOCAB)


def test_sampling_distribution_is_exact(small_vocab_path):
    """Token 0 comes from the prefill, token 1 from the verification of the drafter's sampled drafts (accepted, or
    replaced after a rejection): both follow the target's exact distributions (the oracle's)."""
    from deepseek_v41_ref import V41Reference
    from test_speculative import chi_square_pvalue
    from transformers import AutoTokenizer

    text = json.loads((small_vocab_path / "config.json").read_text())["text_config"]
    tok = AutoTokenizer.from_pretrained(small_vocab_path)
    texts, raw = tok.batch_decode([[i] for i in range(VOCAB)]), tok.convert_ids_to_tokens(list(range(VOCAB)))
    ref = V41Reference(text, load_file(small_vocab_path / "model.safetensors"), texts, raw_tokens=raw)
    prompt, temperature, num = [3, 14, 15, 9, 26, 5], 0.8, 500
    p1 = (ref.logits(prompt)[-1] / temperature).softmax(-1)
    p2 = torch.stack([(ref.logits(prompt + [a])[-1] / temperature).softmax(-1) for a in range(VOCAB)])
    marginals = [p1, (p1[:, None] * p2).sum(0)]
    params = [SamplingParams(max_new_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(num)]
    with Engine(str(small_vocab_path), dtype="float32", kv_cache_tokens=16384, max_num_seqs=1024,
                speculative=SpeculativeConfig(method="dspark", max_draft=1, fixed_length=True)) as e:
        outs = e.generate(input_ids=[prompt] * num, sampling_params=params)
        stats = e.stats["spec"]
    print("DSpark, sampled:", stats)
    assert stats["drafted"] >= num and 0.0 < stats["acceptance_rate"] < 1.0, stats
    alpha = 1e-3
    for j, probs in enumerate(marginals):
        counts = torch.bincount(torch.tensor([o.token_ids[j] for o in outs]), minlength=VOCAB)
        assert chi_square_pvalue(counts, probs) > alpha, j
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=VOCAB)
    assert chi_square_pvalue(counts, marginals[0]) < alpha  # the check has power
