"""DeepSeek-V4 through the Engine: greedy outputs token-identical to transformers `generate` for 8 prompts
batched together, also with small unaligned prefill chunks, with a pool small enough to force retraction, and
with prefix-cache hits at boundaries that cut compression windows (cache on == cache off == transformers).

Prompts run up to 47 tokens (> 4 windows of the largest ratio, 8; the sliding window is 6); four of them share
a 34-token prefix (not a multiple of either ratio), which the prefix cache reuses within one batch.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepinfer_rt
from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer_rt.models.loader import load_model_config
from helpers import hf_greedy

MAX_NEW = 8
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(100, 34)  # >= the scheduler's in-flight prefix threshold, so the batch reuses it
PROMPTS = [_ids(i, n) for i, n in enumerate((3, 9, 17, 12))] + [
    SHARED + _ids(10 + i, n - len(SHARED)) for i, n in enumerate((36, 40, 44, 47))]


def _hf_expected(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf_greedy(hf, p, MAX_NEW, (hf.config.eos_token_id,)) for p in PROMPTS]


@pytest.fixture(scope="module")
def hc2(tiny_v4_path):
    """(checkpoint, transformers greedy continuation of each prompt); the scheduling variants use this one."""
    return tiny_v4_path, _hf_expected(tiny_v4_path)


@pytest.fixture(scope="module")
def hc4(tiny_v4_hc4_path):
    return tiny_v4_hc4_path, _hf_expected(tiny_v4_hc4_path)


def _generate(path, prompts=PROMPTS, params=GREEDY, **engine_kwargs):
    with Engine(str(path), dtype="float32", **{"kv_cache_tokens": 2048, **engine_kwargs}) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return outs, engine.scheduler.num_retractions


@pytest.mark.parametrize("variant", ["hc2", "hc4"])
def test_greedy_batch_matches_hf_generate(request, variant):
    path, expected = request.getfixturevalue(variant)
    outs, _ = _generate(path)
    assert [o.token_ids for o in outs] == expected


def test_small_unaligned_prefill_chunks_with_pages(hc2):
    path, expected = hc2
    outs, _ = _generate(path, chunked_prefill_tokens=7, page_size=4)
    assert [o.token_ids for o in outs] == expected


def test_tiny_pool_forces_retraction(hc2):
    path, expected = hc2
    outs, num_retractions = _generate(path, kv_cache_tokens=100, chunked_prefill_tokens=32)
    assert num_retractions > 0
    assert [o.token_ids for o in outs] == expected


def test_prefix_cache_on_equals_off(hc2):
    """Second round: each prompt extended by its first 3 greedy tokens (prefix hits end mid-window); the
    continuation must be the rest of the first round's, with the cache on and off."""
    path, expected = hc2
    extended = [p + e[:3] for p, e in zip(PROMPTS, expected)]
    params = SamplingParams(max_new_tokens=MAX_NEW - 3, temperature=0)
    # Prompts enter the cache chunk by chunk: with 20-token chunks the shared prefix is reusable mid-batch.
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, chunked_prefill_tokens=20) as engine:
        first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        second = engine.generate(input_ids=extended, sampling_params=params)
    off, _ = _generate(path, extended, params, enable_prefix_cache=False)
    assert [o.token_ids for o in first] == expected
    assert sum(o.cached_tokens for o in first) >= len(SHARED)
    assert all(o.cached_tokens > len(p) for o, p in zip(second, PROMPTS))
    assert [o.token_ids for o in second] == [o.token_ids for o in off] == [e[3:] for e in expected]


def test_dummy_weights_from_config_alone(tiny_v4_path):
    """load_format='dummy': random weights (a filled hash table included) from the config, deterministic by seed."""
    outs = []
    for _ in range(2):
        with Engine(str(tiny_v4_path), dtype="float32", load_format="dummy", kv_cache_tokens=256, seed=3) as engine:
            tid2eid = engine.model.model.layers[0].ffn.gate.tid2eid
            assert len({tuple(row) for row in tid2eid[:64].tolist()}) > 1  # not all tokens on one expert pair
            assert all(len(set(row)) == tid2eid.shape[1] for row in tid2eid[:64].tolist())
            outs.append(engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY))
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(len(o.token_ids) > 0 for o in outs[0])


def test_published_v4_flash_config_builds():
    """The shipped V4-Flash config builds (on the meta device) to the published 284B parameters."""
    config, _ = load_model_config(Path(deepinfer_rt.__file__).parent / "models" / "configs" / "deepseek-v4-flash")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    assert 283e9 < params < 286e9
    assert [t[0] for t in config.raw["layer_types"][:5]] == ["s", "s", "c", "h", "c"]
