"""Batch invariance end to end: a needle prompt's token ids and logprobs (greedy, and seeded temperature 1.0) are
bitwise the same run alone and inside random batches, with random chunk sizes and batch caps, with a cold or
warm prefix cache (including other prompts that share part of the needle), and with a pool small enough that
requests are retracted and recomputed. Trials are cheap (3 new tokens, mostly small batches) so that many fit.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

_NEW_TOKENS = 3
_GREEDY = SamplingParams(max_new_tokens=_NEW_TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
_SAMPLED = SamplingParams(max_new_tokens=_NEW_TOKENS, temperature=1.0, seed=1234, logprobs=True, ignore_eos=True)


def _needle(vocab: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, vocab) for _ in range(45)]


def _other_prompt(rng: random.Random, needle: list[int], vocab: int) -> list[int]:
    tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
    if rng.random() < 0.3:  # shares a prefix with the needle: the needle may hit the cache part way
        return needle[: rng.randrange(1, len(needle))] + tail
    return tail


def _needle_outputs(engine: Engine, needle: list[int], others: list[list[int]], rng: random.Random,
                    max_other_tokens: int = 4):
    """Run the needle (greedy and sampled) among `others` at random places; return the needle's outputs and
    how many prompt tokens each copy found in the prefix cache."""
    prompts = [(p, SamplingParams(max_new_tokens=rng.randrange(1, max_other_tokens + 1),
                                  temperature=rng.choice([0.0, 0.7]), ignore_eos=True)) for p in others]
    for params in (_GREEDY, _SAMPLED):
        prompts.insert(rng.randrange(len(prompts) + 1), (needle, params))
    outs = engine.generate(input_ids=[p for p, _ in prompts], sampling_params=[sp for _, sp in prompts])
    found = [(out, sp) for out, (p, sp) in zip(outs, prompts) if sp is _GREEDY or sp is _SAMPLED]
    key = tuple((tuple(out.token_ids), tuple(out.logprobs)) for out, _ in sorted(found, key=lambda f: f[1] is _SAMPLED))
    return key, [out.cached_tokens for out, _ in found]


def _trial_shape(rng: random.Random, trial: int) -> tuple[int, int, int]:
    """(other prompts, chunk size, batch cap): mostly small batches; every 25th trial a large one."""
    if trial % 25 == 24:
        return rng.randrange(17, 65), rng.choice([256, 2048]), 256
    return rng.randrange(0, 8), rng.choice([7, 16, 64, 2048]), rng.choice([2, 256])


def _check_invariance(path, num_trials: int, num_small_pool_trials: int, pool_tokens: int = 100) -> None:
    rng = random.Random(num_trials)
    with Engine(str(path), dtype="float32", batch_invariant=True, kv_cache_tokens=8192) as engine:
        vocab = engine.model_config.vocab_size
        needle = _needle(vocab)
        baseline, _ = _needle_outputs(engine, needle, [], rng)
        results, cached = {baseline}, set()
        for trial in range(num_trials):
            num_others, chunk, cap = _trial_shape(rng, trial)
            engine.scheduler.config = dataclasses.replace(  # the scheduler reads these at every step
                engine.scheduler.config, chunked_prefill_tokens=chunk, max_num_seqs=cap)
            if rng.random() < 0.5:
                engine.flush_cache()
            key, hits = _needle_outputs(engine, needle, [_other_prompt(rng, needle, vocab)
                                                         for _ in range(num_others)], rng)
            results.add(key)
            cached.update(hit > 0 for hit in hits)
    with Engine(str(path), dtype="float32", batch_invariant=True, kv_cache_tokens=pool_tokens,
                chunked_prefill_tokens=32) as small:
        for _ in range(num_small_pool_trials):
            key, _ = _needle_outputs(small, needle, [[rng.randrange(3, vocab) for _ in range(30)]
                                                     for _ in range(4)], rng, max_other_tokens=16)
            results.add(key)
        assert small.stats["num_retractions"] > 0
    assert cached == {True, False}  # both prefix-cache hits and misses were exercised
    assert len(results) == 1, f"{len(results)} distinct needle outputs over {num_trials} trials"


@pytest.fixture
def one_thread():
    """Invariance holds for any fixed thread count (the op tests run on two); one thread keeps many small
    trials fast on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_deepseek_v3_batch_invariant(tiny_v3_path, one_thread):
    """MLA, shared + routed experts; the 100-trial form below is `slow`."""
    _check_invariance(tiny_v3_path, num_trials=40, num_small_pool_trials=2)


@pytest.mark.slow
def test_tiny_deepseek_v3_batch_invariant_100_trials(tiny_v3_path, one_thread):
    _check_invariance(tiny_v3_path, num_trials=100, num_small_pool_trials=4)


def test_tiny_deepseek_v4_batch_invariant(tiny_v4_path, one_thread):
    """Sliding-window, compressed (CSA with indexer, HCA) attention, hyper-connections and hash/learned MoE."""
    _check_invariance(tiny_v4_path, num_trials=40, num_small_pool_trials=2)


def test_smollm2_batch_invariant(smollm2_path, one_thread):
    """The embedded default in the default run; the 100-trial form below is `slow`."""
    _check_invariance(smollm2_path, num_trials=12, num_small_pool_trials=1)


@pytest.mark.slow
def test_smollm2_batch_invariant_100_trials(smollm2_path, one_thread):
    _check_invariance(smollm2_path, num_trials=100, num_small_pool_trials=4)


def test_default_path_is_not_batch_invariant(smollm2_engine):
    """Without the switch the same needle's logprobs change with its batch (GEMM kernels chosen by row count,
    attention padded to the batch's longest sequence), so the invariant path is really a different one."""
    rng = random.Random(3)
    needle = _needle(49152)
    smollm2_engine.flush_cache()
    alone, _ = _needle_outputs(smollm2_engine, needle, [], rng)
    smollm2_engine.flush_cache()
    batched, _ = _needle_outputs(smollm2_engine, needle, [[rng.randrange(3, 49152) for _ in range(rng.randrange(
        20, 60))] for _ in range(12)], rng)
    assert alone != batched
