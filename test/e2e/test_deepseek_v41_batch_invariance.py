"""DeepSeek-V4.1 in batch-invariant mode: a needle prompt's tokens and logprobs (greedy, and seeded temperature 1.0)
are bitwise the same alone and inside random batches of other prompts, with random chunk sizes and batch caps and a
cold or warm prefix cache (test_batch_invariance.py's trials), in fp32 and bf16, on both tiny configs (every layer
kind: ratio 0 / 1 / 2, KV / index / candidate sources and readers, Engram, YOCO, shifted and V4 mHC). The DSpark
drafter's case and the check's power (the default path fails it): test_deepseek_v41_dspark_invariance.py."""
from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

from deepinfer_rt import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_batch_invariance import _needle, _needle_outputs, _other_prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
NUM_TRIALS = 3
"""Enough: on the default path 3 such trials already give 2-5 distinct needle outputs on these configs."""


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


@pytest.mark.parametrize("variant, dtype", [("a", "float32"), ("b", "float32"), ("b", "bfloat16")])
def test_v41_batch_invariant(tiny_v41_paths, variant, dtype):
    """(Config 'a' in bf16: with the DSpark drafter, test_deepseek_v41_dspark_invariance.py.)"""
    rng = random.Random(f"{variant}-{dtype}")
    with Engine(str(tiny_v41_paths[variant]), dtype=dtype, batch_invariant=True, kv_cache_tokens=4096) as engine:
        needle = _needle(engine.model_config.vocab_size)
        results, cached = _trials(engine, needle, rng, NUM_TRIALS, _needle_outputs)
    assert cached == {True, False}  # prefix-cache hits and misses were both exercised
    assert len(results) == 1, f"{len(results)} distinct needle outputs"
