"""DeepSeek-V4.1 with the DSpark drafter in batch-invariant mode (fixed draft length, bf16), and the power of the V4.1
invariance trials (test_deepseek_v41_batch_invariance.py): without the switch the same trials change the needle."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_batch_invariance import _needle, _needle_outputs  # noqa: E402
from test_deepseek_v41_batch_invariance import NUM_TRIALS, _trials  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def _dspark_run(engine: Engine, needle, others, rng, with_stats=True):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    prompts = [(p, SamplingParams(max_new_tokens=rng.randrange(1, 8), temperature=rng.choice([0.0, 0.8]),
                                  ignore_eos=True)) for p in others]
    for params in (greedy, sampled):
        prompts.insert(rng.randrange(len(prompts) + 1), (needle, params))
    outs = engine.generate(input_ids=[p for p, _ in prompts], sampling_params=[sp for _, sp in prompts])
    mine = [next(o for o, (_, sp) in zip(outs, prompts) if sp is want) for want in (greedy, sampled)]
    if not with_stats:
        return tuple(mine[0].token_ids), [o.cached_tokens for o in mine]
    key = tuple((tuple(o.token_ids), tuple(sorted(o.spec_stats.items()))) for o in mine)
    return key, [o.cached_tokens for o in mine]


def test_v41_dspark_fixed_length_batch_invariant(dspark_v41_path):
    """Verification of a fixed number of drafts: the needle's tokens and draft statistics (drafted, accepted) do
    not depend on the batch; the sampled copy's acceptance reads the drafter's probabilities, so the drafter is
    batch-invariant too. A small chunk budget shared with other prompts may cut drafts: the statistics change, and a
    sampled request's tokens too (a rejection-sampled draft and a plain draw are different exact samplers of the
    same distribution), greedy tokens never; so there only greedy tokens are compared."""
    rng = random.Random(4)
    spec = SpeculativeConfig("dspark", fixed_length=True)
    with Engine(str(dspark_v41_path), dtype="bfloat16", batch_invariant=True, kv_cache_tokens=4096,
                speculative=spec) as engine:
        assert engine.spec.fixed_length  # what the planner reads: every proposed draft is verified
        needle = _needle(engine.model_config.vocab_size)[:20]
        results, _ = _trials(engine, needle, rng, 2, _dspark_run, chunks=(2048,))
        assert len(results) == 1, f"{len(results)} distinct needle outputs"
        (key,) = results
        assert all(dict(stats)["drafted"] > 0 for _, stats in key), key
        tokens, _ = _trials(engine, needle, rng, 2, lambda *a: _dspark_run(*a, with_stats=False), chunks=(7, 16))
    assert tokens == {key[0][0]}


def test_default_path_is_not_batch_invariant(tiny_v41_paths):
    with Engine(str(tiny_v41_paths["b"]), dtype="float32", kv_cache_tokens=4096) as engine:
        needle = _needle(engine.model_config.vocab_size)
        results, _ = _trials(engine, needle, random.Random("b-float32"), NUM_TRIALS, _needle_outputs)
    assert len(results) > 1
