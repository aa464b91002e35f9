"""DeepSeek-V4.1 in batch-invariant mode: a needle prompt's tokens and logprobs (greedy, and seeded temperature 1.0)
are bitwise the same alone and inside random batches of other prompts, with random chunk sizes and batch caps and a
cold or warm prefix cache (test_batch_invariance.py's trials), in fp32 and bf16, on both tiny configs (every layer
kind: ratio 0 / 1 / 2, KV / index / candidate sources and readers, Engram, YOCO, shifted and V4 mHC). Also with the
DSpark drafter at its fixed draft length: tokens and draft statistics."""
from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_batch_invariance import _needle, _needle_outputs, _other_prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def _trials(engine: Engine, needle: list[int], rng: random.Random, num_trials: int, run,
            chunks=(7, 16, 2048)) -> tuple[set, set]:
    """The needle's results alone, then over trials of 0-6 other prompts with random chunk sizes and batch caps,
    the prefix cache flushed half the time."""
    vocab = engine.model_config.vocab_size
    results, cached = set(), set()
    key, _ = run(engine, needle, [], rng)
    results.add(key)
    for trial in range(num_trials):
        engine.scheduler.config = dataclasses.replace(
            engine.scheduler.config, chunked_prefill_tokens=rng.choice(chunks), max_num_seqs=rng.choice([2, 256]))
        if trial % 2:
            engine.flush_cache()
        others = [_other_prompt(rng, needle, vocab) for _ in range(rng.randrange(0 if trial else 1, 7))]
        key, hits = run(engine, needle, others, rng)
        results.add(key)
        cached.update(hit > 0 for hit in hits)
    return results, cached


@pytest.mark.parametrize("variant, dtype", [("a", "float32"), ("b", "float32"), ("a", "bfloat16"), ("b", "bfloat16")])
def test_v41_batch_invariant(tiny_v41_paths, variant, dtype):
    rng = random.Random(hash((variant, dtype)) % 1000)
    with Engine(str(tiny_v41_paths[variant]), dtype=dtype, batch_invariant=True, kv_cache_tokens=4096) as engine:
        needle = _needle(engine.model_config.vocab_size)
        results, cached = _trials(engine, needle, rng, 8, _needle_outputs)
    assert cached == {True, False}  # prefix-cache hits and misses were both exercised
    assert len(results) == 1, f"{len(results)} distinct needle outputs"


def _dspark_run(engine: Engine, needle, others, rng, with_stats=True):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    prompts = [(p, SamplingParams(max_new_tokens=rng.randrange(1, 8), temperature=rng.choice([0.0, 0.8]),
                                  ignore_eos=True)) for p in others]
    for params in (greedy, sampled):
        prompts.insert(rng.randrange(len(prompts) + 1), (needle, params))
    outs = engine.generate(input_ids=[p for p, _ in prompts], sampling_params=[sp for _, sp in prompts])
    mine = [o for o, (_, sp) in zip(outs, prompts) if sp is greedy or sp is sampled]
    key = tuple((tuple(o.token_ids), tuple(sorted(o.spec_stats.items())) if with_stats else ()) for o in mine)
    return key, [o.cached_tokens for o in mine]


def test_v41_dspark_fixed_length_batch_invariant(dspark_v41_path):
    """Verification of a fixed number of drafts: the needle's tokens and draft statistics (drafted, accepted) do
    not depend on the batch; the sampled copy's acceptance reads the drafter's probabilities, so the drafter is
    batch-invariant too. Small chunk budgets may cut drafts (statistics change, never tokens): tokens only there."""
    rng = random.Random(4)
    spec = SpeculativeConfig("dspark", fixed_length=True)
    with Engine(str(dspark_v41_path), dtype="float32", batch_invariant=True, kv_cache_tokens=4096,
                speculative=spec) as engine:
        assert engine.spec.fixed_length  # what the planner reads: every proposed draft is verified
        needle = _needle(engine.model_config.vocab_size)[:20]
        results, _ = _trials(engine, needle, rng, 4, _dspark_run, chunks=(2048,))
        assert len(results) == 1, f"{len(results)} distinct needle outputs"
        (key,) = results
        assert all(dict(stats)["drafted"] > 0 for _, stats in key), key
        tokens, _ = _trials(engine, needle, rng, 3, lambda *a: _dspark_run(*a, with_stats=False), chunks=(7, 16))
    assert tokens == {tuple((t, ()) for t, _ in key)}
