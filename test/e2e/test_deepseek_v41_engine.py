"""DeepSeek-V4.1 through the Engine: greedy outputs of 8 prompts (1 to 120 tokens) batched together are the oracle's
greedy tokens (test/reference/deepseek_v41_ref.py: each continuation's next-token argmax over prompt + output, which
for a causal model is its greedy decode), all 8 on tiny config 'a', 4 of them (5 to 120 tokens) on 'b'; on config 'a' the same tokens with 7-token prefill
chunks and 4-token pages, with a pool small enough to force retraction, and with prefix-cache hits that end
mid-window (cache on == cache off). Image placeholders are refused at submission.
"""
from __future__ import annotations

import json

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_NEW = 6
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(100, 37)  # >= the scheduler's in-flight prefix threshold; odd, so hits cut ratio-2 windows
PROMPTS = [_ids(i, n) for i, n in enumerate((1, 5, 13, 30))] + [
    SHARED + _ids(10 + i, n - len(SHARED)) for i, n in enumerate((41, 64, 90, 120))]


def _generate(path, prompts=PROMPTS, params=GREEDY, **engine_kwargs):
    with Engine(str(path), dtype="float32", **{"kv_cache_tokens": 2048, **engine_kwargs}) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [o.token_ids for o in outs], engine.scheduler.num_retractions


@pytest.fixture(scope="module")
def greedy(tiny_v41_paths, v41_oracles):
    """variant -> the engine's default greedy outputs, checked against the oracle once here."""
    out = {}
    for variant, path in tiny_v41_paths.items():
        tokens, _ = _generate(path)
        oracle = v41_oracles[variant]
        checked = range(len(PROMPTS)) if variant == "a" else range(1, len(PROMPTS), 2)  # b: 4 of 8, for time
        for prompt, got in ((PROMPTS[i], tokens[i]) for i in checked):
            assert len(got) == MAX_NEW
            logits = oracle.logits(prompt + got[:-1])
            assert logits[len(prompt) - 1 :].argmax(dim=-1).tolist() == got, f"prompt of {len(prompt)} tokens"
        out[variant] = tokens
    return out


def test_greedy_batch_matches_oracle(greedy):
    assert set(greedy) == {"a", "b"}  # the fixture compared every continuation with the oracle


def test_small_unaligned_prefill_chunks_with_pages(tiny_v41_paths, greedy):
    tokens, _ = _generate(tiny_v41_paths["a"], chunked_prefill_tokens=7, page_size=4)
    assert tokens == greedy["a"]


def test_tiny_pool_forces_retraction(tiny_v41_paths, greedy):
    tokens, num_retractions = _generate(tiny_v41_paths["a"], kv_cache_tokens=200, chunked_prefill_tokens=32)
    assert num_retractions > 0
    assert tokens == greedy["a"]


def test_prefix_cache_on_equals_off(tiny_v41_paths, greedy):
    """Second round: each prompt extended by its first 3 greedy tokens (hits end mid-window and mid-block); the
    continuation is the rest of the first round's, with the cache on and off."""
    path, expected = tiny_v41_paths["a"], greedy["a"]
    extended = [p + e[:3] for p, e in zip(PROMPTS, expected)]
    params = SamplingParams(max_new_tokens=MAX_NEW - 3, temperature=0, ignore_eos=True)
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, chunked_prefill_tokens=20) as engine:
        first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        second = engine.generate(input_ids=extended, sampling_params=params)
    off, _ = _generate(path, extended, params, enable_prefix_cache=False)
    assert [o.token_ids for o in first] == expected
    assert sum(o.cached_tokens for o in first) >= len(SHARED)
    assert all(o.cached_tokens > len(p) for o, p in zip(second, PROMPTS))
    assert [o.token_ids for o in second] == off == [e[3:] for e in expected]


def test_image_placeholder_refused(tiny_v41_paths, tmp_path):
    src = tiny_v41_paths["a"]
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    raw = json.loads((src / "config.json").read_text())
    raw.update(vision_config={"model_type": "deepseek_v41_vision"}, image_token_id=20000)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with Engine(str(tmp_path), dtype="float32", kv_cache_tokens=256) as engine:
        with pytest.raises(ValueError, match=r"input_ids\[1\].*image"):
            engine.generate(input_ids=[[5, 6], [7, 20000]], sampling_params=GREEDY)
        assert engine.generate(input_ids=[[5, 6]], sampling_params=GREEDY)[0].token_ids


def test_bf16_and_dummy_weights_run(tiny_v41_paths):
    """bf16 (the fp32 compressor state leaving in bf16) serves without errors; load_format='dummy' draws the same
    weights for the same seed."""
    path = tiny_v41_paths["b"]
    with Engine(str(path), dtype="bfloat16", kv_cache_tokens=512) as engine:
        outs = engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)
    assert all(o.error is None and len(o.token_ids) == MAX_NEW for o in outs)
    dummy = [_generate(path, PROMPTS[:2], load_format="dummy", seed=3, kv_cache_tokens=512)[0] for _ in range(2)]
    assert dummy[0] == dummy[1] and all(len(t) == MAX_NEW for t in dummy[0])


def test_yoco_prefill_truncation_keeps_greedy_outputs(tiny_v41_paths, greedy, monkeypatch):
    """With DEEPINFER_V41_YOCO_TRUNCATION=1 (config 'b', whose consumers select on their own) greedy outputs do
    not move, whole prompts or 7-token chunks; prompt logprobs are refused."""
    monkeypatch.setenv("DEEPINFER_V41_YOCO_TRUNCATION", "1")
    path = tiny_v41_paths["b"]
    assert _generate(path)[0] == greedy["b"]
    assert _generate(path, chunked_prefill_tokens=7)[0] == greedy["b"]
    with Engine(str(path), dtype="float32", kv_cache_tokens=256) as engine:
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.generate(input_ids=[PROMPTS[2]], sampling_params=SamplingParams(max_new_tokens=1,
                                                                                 prompt_logprobs=True))


def test_overlap_steps_aside_for_engram(tiny_v41_paths, greedy, monkeypatch):
    """Engram hashes each step's token ids on the host, where an overlapped decode step still holds placeholders:
    with overlap scheduling asked for (DEEPINFER_OVERLAP=1, as on CUDA) V4.1 runs synchronously, same tokens."""
    monkeypatch.setenv("DEEPINFER_OVERLAP", "1")
    with Engine(str(tiny_v41_paths["a"]), dtype="float32", kv_cache_tokens=2048) as engine:
        assert engine.model.supports_overlap is False and engine.executor.is_overlap_enabled is False
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == greedy["a"]
