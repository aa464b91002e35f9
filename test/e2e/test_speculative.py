"""Speculative decoding end to end: outputs with speculation equal outputs without it (greedy, and seeded
sampling with deterministic drafts), under the prefix cache, paging, chunked prefill, retraction and
structured output; MTP drafting on tiny DeepSeek-V3; and exact sampling with bad drafters (chi-square).

Random tiny models rarely repeat themselves, so most tests use an oracle drafter: it proposes the known
reference continuation with some positions corrupted, which forces partial acceptance and rollback every step.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig
from deepinfer_rt.speculative.drafter import Drafter, Proposal

PROMPTS = [[5, 17, 300, 9, 17, 300, 9, 44, 81, 2000], [100, 200, 300, 400, 100, 200, 7, 8],
           list(range(1000, 1040)), [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)


class OracleDrafter(Drafter):
    """Proposes the reference continuation of each prompt; draft i of a step is corrupted (id + 1) when
    (7 * num_tokens + 13 * i) % corrupt_mod == 0, so steps mix full, partial and no acceptance."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], corrupt_mod: int = 3):
        self.references = references
        self.corrupt_mod = corrupt_mod

    def propose(self, req, k):
        full = list(req.prompt_ids) + self.references.get(tuple(req.prompt_ids), [])
        n = req.num_tokens
        if full[:n] != req.token_ids or n >= len(full):
            return None
        tokens = [t + 1 if (n * 7 + i * 13) % self.corrupt_mod == 0 else t
                  for i, t in enumerate(full[n : n + k])]
        return Proposal(tokens, [0.9] * len(tokens), None, n)


def oracle(refs_outs, prompts=PROMPTS, **kwargs) -> SpeculativeConfig:
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, refs_outs)}
    return SpeculativeConfig(drafter=OracleDrafter(refs), max_draft=4, **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096) as e:
        return e.generate(input_ids=PROMPTS, sampling_params=GREEDY)


def assert_spec_active(engine: Engine, outs) -> None:
    stats = engine.stats["spec"]
    assert 0 < stats["accepted"] < stats["drafted"], stats
    assert stats["drafted"] == sum(o.spec_stats["drafted"] for o in outs if o.spec_stats)
    assert stats["accepted"] == sum(o.spec_stats["accepted"] for o in outs if o.spec_stats)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(enable_prefix_cache=False),
    dict(page_size=4),
    dict(kv_cache_tokens=96, chunked_prefill_tokens=16, page_size=2),  # chunked prefill + retraction
])
def test_greedy_identical_with_oracle_drafts(tiny_llama_path, reference, kwargs):
    kwargs = dict(dict(kv_cache_tokens=4096), **kwargs)
    with Engine(str(tiny_llama_path), dtype="float32", speculative=oracle(reference), **kwargs) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        # The same prompts again: prefix-cache hits over KV written by verification steps.
        again = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert_spec_active(e, outs + again)
        if kwargs["kv_cache_tokens"] < 100:
            assert e.stats["num_retractions"] > 0
        if kwargs.get("enable_prefix_cache", True):
            assert any(o.cached_tokens for o in again)
    for ref, out, out2 in zip(reference, outs, again):
        assert out.token_ids == ref.token_ids
        assert out2.token_ids == ref.token_ids


def test_seeded_sampling_identical_with_deterministic_drafts(tiny_llama_path):
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, top_k=50, seed=s, repetition_penalty=1.3,
                             min_new_tokens=10) for s in range(len(PROMPTS))]
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096) as e:
        ref = e.generate(input_ids=PROMPTS, sampling_params=params)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096, speculative=oracle(ref)) as e:
        outs = e.generate(input_ids=PROMPTS, sampling_params=params)
        assert_spec_active(e, outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_structured_output_identical(tiny_llama_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = [SamplingParams(max_new_tokens=40, temperature=0, json_schema=json.dumps(schema)),
              SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, regex=r"[a-z]{2,6}-\d{3,5}"),
              SamplingParams(max_new_tokens=40, temperature=0.7, seed=5, json_schema=json.dumps(schema))]
    prompts = PROMPTS[:3]
    # Grammars compile on a worker thread and a request waits for its own, so which requests share a step
    # depends on timing (a loaded machine); batch-invariant mode keeps each row's logits independent of that.
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096, batch_invariant=True) as e:
        ref = e.generate(input_ids=prompts, sampling_params=params)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096, batch_invariant=True,
                speculative=oracle(ref, prompts)) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        assert_spec_active(e, outs)
    for r, o in zip(ref, outs):
        assert (o.token_ids, o.text, o.finish_reason) == (r.token_ids, r.text, r.finish_reason)


def test_logprob_requests_decode_plainly(tiny_llama_path, reference):
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, logprobs=True)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096) as e:
        ref = e.generate(input_ids=PROMPTS, sampling_params=params)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096,
                speculative=oracle(reference)) as e:
        outs = e.generate(input_ids=PROMPTS + PROMPTS, sampling_params=[params] * 4 + [GREEDY] * 4)
    for r, o in zip(ref, outs[:4]):
        assert o.token_ids == r.token_ids and o.spec_stats is None
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in reference]


def test_fixed_length_needle_is_batch_invariant(tiny_llama_path, reference):
    """Fixed-length drafting: how much a request verifies never depends on its batch neighbours."""
    spec = oracle(reference, fixed_length=True)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096, batch_invariant=True,
                speculative=spec, enable_prefix_cache=False) as e:
        alone = e.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0]
        crowd = e.generate(input_ids=PROMPTS * 3, sampling_params=GREEDY)
    for needle in crowd[::len(PROMPTS)]:
        assert (needle.token_ids, needle.spec_stats) == (alone.token_ids, alone.spec_stats)


def test_prompt_lookup_smollm2_identical(smollm2_engine, smollm2_path):
    data = (Path(__file__).parents[2] / "examples/data/people.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in data[:2]]
    prompts = [f"Copy the sentence exactly.\nSentence: {r['text']}\nCopy: " for r in rows]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    ref = smollm2_engine.generate(prompts, sampling_params=params)
    with Engine(str(smollm2_path), dtype="float32", kv_cache_tokens=4096, speculative="prompt_lookup") as e:
        outs = e.generate(prompts, sampling_params=params)
        assert e.stats["spec"]["accepted"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_bad_speculative_argument(tiny_llama_path):
    with pytest.raises(ValueError, match="speculative"):
        Engine(str(tiny_llama_path), speculative="medusa")
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        Engine(str(tiny_llama_path), speculative="mtp")


# ---- DeepSeek MTP drafts on tiny DeepSeek-V3 ----

def add_mtp_layer(src: Path, dst: Path, seed: int = 1) -> Path:
    """A copy of the tiny V3 checkpoint with a random MTP layer model.layers.{N}.* as DeepSeek stores it:
    a decoder layer (here layer 1's tensors, perturbed) plus enorm, hnorm, eh_proj, shared_head and copies of
    the embedding and output head."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    out = {}
    with safe_open(str(src / "model.safetensors"), "pt") as sf:
        for name in sf.keys():
            if name.startswith("model.layers.1."):
                t = sf.get_tensor(name)
                out[f"model.layers.{n}." + name[len("model.layers.1."):]] = t + 0.05 * torch.randn(t.shape, generator=gen)
        hidden = sf.get_tensor("model.embed_tokens.weight").shape[1]
        out[f"model.layers.{n}.embed_tokens.weight"] = sf.get_tensor("model.embed_tokens.weight")
        out[f"model.layers.{n}.shared_head.head.weight"] = sf.get_tensor("lm_head.weight")
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{n}.{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    out[f"model.layers.{n}.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    save_file(out, str(dst / "mtp.safetensors"))
    return dst


@pytest.fixture(scope="module")
def tiny_v3_mtp_path(tiny_v3_path, tmp_path_factory):
    return add_mtp_layer(tiny_v3_path, tmp_path_factory.mktemp("tiny-v3-mtp") / "ckpt")


MTP = SpeculativeConfig("mtp", fixed_length=True, max_draft=3)


def test_mtp_greedy_identical(tiny_v3_mtp_path):
    prompts = PROMPTS[:3] + [PROMPTS[2][:30] + [7, 8]]  # the last one hits the prefix cache
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine(str(tiny_v3_mtp_path), dtype="float32", kv_cache_tokens=2048) as e:
        ref = e.generate(input_ids=prompts, sampling_params=params)
    with Engine(str(tiny_v3_mtp_path), dtype="float32", kv_cache_tokens=2048, page_size=2,
                chunked_prefill_tokens=16, speculative=MTP) as e:
        outs = e.generate(input_ids=prompts[:3], sampling_params=params)
        outs += e.generate(input_ids=prompts[3:], sampling_params=params)
        assert e.stats["spec"]["drafted"] > 0
        assert outs[3].cached_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_mtp_drafts_from_incremental_kv_match_a_fresh_prefill(tiny_v3_mtp_path):
    """The MTP layer's KV, extended step by step through verification and rollback, equals the KV a single
    prefill of the final sequence writes: both give the same next drafts and confidences."""
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    with Engine(str(tiny_v3_mtp_path), dtype="float32", kv_cache_tokens=2048, speculative=MTP) as e:
        out = e.generate(input_ids=PROMPTS[:1], sampling_params=params)[0]
        (incremental,) = e.spec.drafter._proposals.values()
    sequence = PROMPTS[0] + out.token_ids
    with Engine(str(tiny_v3_mtp_path), dtype="float32", kv_cache_tokens=2048, speculative=MTP,
                enable_prefix_cache=False) as e:
        last = e.generate(input_ids=[sequence[:-1]], sampling_params=dataclasses.replace(params, max_new_tokens=1))[0]
        (fresh,) = e.spec.drafter._proposals.values()
    assert last.token_ids == sequence[-1:]
    assert incremental.tokens == fresh.tokens
    assert incremental.confidences == pytest.approx(fresh.confidences, abs=1e-4)


def test_mtp_random_under_dummy_load(tiny_v3_path):
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with Engine(str(tiny_v3_path), dtype="float32", kv_cache_tokens=1024, load_format="dummy") as e:
        ref = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0, n=2, ignore_eos=True)
    with Engine(str(tiny_v3_path), dtype="float32", kv_cache_tokens=1024, load_format="dummy",
                speculative=MTP) as e:
        outs = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
        # Sampled requests verify drafts drawn from the head's distribution (rejection sampling).
        drafted = e.stats["spec"]["drafted"]
        assert all(o.completion_tokens == 6 for o in e.generate(input_ids=PROMPTS[:2], sampling_params=sampled))
        assert e.stats["spec"]["drafted"] > drafted
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    with pytest.raises(ValueError, match="no MTP layer"):
        Engine(str(tiny_v3_path), dtype="float32", kv_cache_tokens=1024, speculative="mtp")


# ---- exact sampling: empirical distribution with bad drafters equals the target's ----

VOCAB = 48


class BadStochasticDrafter(Drafter):
    """Draws drafts from a fixed distribution q unrelated to the model (its own RNG), reporting q."""

    def __init__(self):
        gen = torch.Generator().manual_seed(123)
        q = torch.rand(VOCAB, generator=gen).pow(4) + 1e-3  # peaked on a few tokens the model may not like
        self.q = q / q.sum()

    def propose(self, req, k):
        gen = torch.Generator().manual_seed(req.rid * 1000 + req.num_tokens)
        tokens = torch.multinomial(self.q, k, replacement=True, generator=gen).tolist()
        return Proposal(tokens, [0.9] * k, self.q.expand(k, VOCAB).clone(), req.num_tokens)


class BadDeterministicDrafter(Drafter):
    """Cycles through a few fixed tokens whatever the context (often right, mostly wrong)."""

    def __init__(self, candidates: list[int]):
        self.candidates = candidates

    def propose(self, req, k):
        tokens = [self.candidates[(req.rid + i) % len(self.candidates)] for i in range(k)]
        return Proposal(tokens, [0.9] * k, None, req.num_tokens)


@pytest.fixture(scope="module")
def small_vocab_llama(tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama-v48"), seed=3, vocab_size=VOCAB)


def target_marginals(path: Path, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """Exact distributions of output tokens 1, 2 and 3 under the transformers model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        return (model(torch.tensor(contexts)).logits[:, -1] / temperature).softmax(-1)

    with torch.no_grad():
        p1 = next_probs([prompt])[0]
        p2 = next_probs([prompt + [a] for a in range(VOCAB)])  # (V, V): p(t2 | t1 = a)
        p3 = next_probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2
    return [p1, joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square; cells expected below 5 are pooled into one."""
    from scipy.stats import chisquare

    expected = probs.double() * counts.sum()
    small = expected < 5
    obs, exp = counts[~small].double(), expected[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum(0, keepdim=True).double()])
        exp = torch.cat([exp, expected[small].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("drafter", [BadStochasticDrafter, BadDeterministicDrafter])
def test_sampling_distribution_is_exact(small_vocab_llama, drafter):
    """Token 1 comes from the prefill; tokens 2 and 3 from a verification of two bad drafts (accepted,
    replaced after a rejection, or the bonus token), so their marginals test the verification rule."""
    prompt, temperature, num = [3, 14, 15, 9, 26, 5], 0.6, 1200
    marginals = target_marginals(small_vocab_llama, prompt, temperature)
    if drafter is BadDeterministicDrafter:
        drafter = functools.partial(drafter, [int(marginals[1].argmax()), int(marginals[2].argmax())])
    params = [SamplingParams(max_new_tokens=4, temperature=temperature, seed=s, ignore_eos=True)
              for s in range(num)]
    with Engine(str(small_vocab_llama), dtype="float32", kv_cache_tokens=32768, max_num_seqs=1024,
                speculative=SpeculativeConfig(drafter=drafter(), max_draft=2, fixed_length=True)) as e:
        outs = e.generate(input_ids=[prompt] * num, sampling_params=params)
        stats = e.stats["spec"]
    assert stats["drafted"] >= 2 * num and 0.05 < stats["acceptance_rate"] < 0.9, stats  # many rejections
    alpha = 1e-3
    for j, probs in enumerate(marginals):
        counts = torch.bincount(torch.tensor([o.token_ids[j] for o in outs]), minlength=VOCAB)
        assert chi_square_pvalue(counts, probs) > alpha, j
    # The test has power: the same counts against another position's distribution fail it.
    counts = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=VOCAB)
    assert chi_square_pvalue(counts, marginals[0]) < alpha


class NoDrafter(Drafter):
    def propose(self, req, k):
        return None


def test_grammar_forced_tokens_are_drafted(tiny_llama_path):
    """A constrained request drafts the text its grammar forces, even when the drafter has nothing."""
    params = SamplingParams(max_new_tokens=24, temperature=0, regex=r"name: [a-z]{1,5}, id: [0-9]{2}")
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=2048) as e:
        ref = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
    spec = SpeculativeConfig(drafter=NoDrafter(), fixed_length=True)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=2048, speculative=spec) as e:
        outs = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
        assert e.stats["spec"]["accepted"] > 0
    assert [(o.token_ids, o.text) for o in outs] == [(r.token_ids, r.text) for r in ref]
