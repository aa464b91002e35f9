"""Engine modes on CUDA (skipped without a GPU): DeepSeek-V4 against the CPU reference engine, batch-invariant
mode with the Triton kernels (a needle's ids and logprobs bitwise the same alone and inside random batches with
random chunking), and speculative decoding (greedy tokens the same with speculation on and off)."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)


def _tiny(kind: str, tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


def _prompts(rng: random.Random, vocab: int, lengths) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_gpu_v4_matches_cpu_reference(tmp_path_factory):
    path = _tiny("deepseek_v4", tmp_path_factory)
    kw = dict(dtype="float32", kv_cache_tokens=4096, max_num_seqs=8, chunked_prefill_tokens=13)
    with Engine(str(path), device="cpu", **kw) as cpu:
        prompts = _prompts(random.Random(0), cpu.model_config.vocab_size, (5, 23, 47))
        ref = cpu.generate(input_ids=prompts, sampling_params=GREEDY)
    with Engine(str(path), device="cuda", **kw) as gpu:
        out = gpu.generate(input_ids=prompts, sampling_params=GREEDY)
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 2e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_batch_invariant_engine(tmp_path_factory, dtype):
    path = _tiny("deepseek_v3", tmp_path_factory)
    rng = random.Random(1)
    params = [GREEDY, SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, logprobs=True, ignore_eos=True)]
    seen = set()
    for trial in range(12):
        chunk = rng.choice([7, 32, 2048])
        with Engine(str(path), dtype=dtype, device="cuda", batch_invariant=True, kv_cache_tokens=8192,
                    max_num_seqs=64, chunked_prefill_tokens=chunk) as engine:
            vocab = engine.model_config.vocab_size
            needle = _prompts(random.Random(99), vocab, (37,))[0]
            others = _prompts(rng, vocab, [rng.randrange(3, 90) for _ in range(rng.choice([0, 3, 15, 40]))])
            at = rng.randrange(len(others) + 1)
            batch = others[:at] + [needle] + others[at:]
            for sp in params:
                out = engine.generate(input_ids=batch, sampling_params=sp)[at]
                seen.add((sp.temperature, tuple(out.token_ids), tuple(out.logprobs)))
    assert len(seen) == len(params), "the needle's output changed with its batch"


def test_gpu_speculative_greedy_unchanged(tmp_path_factory):
    path = _tiny("llama", tmp_path_factory)
    rng = random.Random(2)
    # Prompts that repeat themselves, so prompt lookup finds drafts.
    prompts = []
    for n in (6, 11, 17):
        base = _prompts(rng, 1000, (n,))[0]
        prompts.append(base * 3)
    outs = {}
    # Fixed length: verify every draft, so the test exercises verification whatever the drafts' confidence.
    for spec in (None, SpeculativeConfig("prompt_lookup", fixed_length=True)):
        with Engine(str(path), dtype="float32", device="cuda", kv_cache_tokens=4096, max_num_seqs=8,
                    speculative=spec) as engine:
            # Long enough for a random model to fall into the loops that prompt lookup drafts from.
            params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
            outs[spec] = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
            if spec:
                assert engine.stats["spec"]["drafted"] > 0
    assert outs[None] == outs[spec]
