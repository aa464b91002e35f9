"""The compact DeepSeek-V4 pool against the per-token layout it replaces, through the Engine: the same greedy
tokens with pages and unaligned chunks, under retraction, and with prefix-cache hits that resume mid-window
(resumable at checkpoints and where a sequence ended); cache on == off."""
from __future__ import annotations

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.models.deepseek_v4.cache import V4Pool
from test_deepseek_v4_engine import GREEDY, MAX_NEW, PROMPTS


def _run(path, layout: str, monkeypatch, rounds=1, checkpoint_tokens=8, **kwargs):
    monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", layout)
    monkeypatch.setenv("DEEPINFER_V4_CHECKPOINT_TOKENS", str(checkpoint_tokens))
    monkeypatch.setenv("DEEPINFER_V4_RELEASE_MARGIN", "0")  # release as early as exactness allows
    with Engine(str(path), dtype="float32", **{"kv_cache_tokens": 2048, "page_size": 4, **kwargs}) as engine:
        assert isinstance(engine.pool, V4Pool) == (layout == "compact")
        first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        outs = [first]
        if rounds == 2:
            extended = [p + o.token_ids[:3] for p, o in zip(PROMPTS, first)]
            outs.append(engine.generate(input_ids=extended,
                                        sampling_params=SamplingParams(max_new_tokens=MAX_NEW - 3, temperature=0)))
        stats = dict(retractions=engine.scheduler.num_retractions)
        if isinstance(engine.pool, V4Pool):
            stats.update(recent_pages=engine.pool.num_recent_in_use, main_pages=engine.pool.allocator.num_pages
                         - engine.pool.allocator.num_free)
        return [[o.token_ids for o in r] for r in outs], [[o.cached_tokens for o in r] for r in outs], stats


def test_compact_equals_per_token_with_pages_and_chunks(tiny_v4_path, monkeypatch):
    want, _, _ = _run(tiny_v4_path, "per_token", monkeypatch, chunked_prefill_tokens=7, enable_prefix_cache=False)
    got, _, stats = _run(tiny_v4_path, "compact", monkeypatch, chunked_prefill_tokens=7, enable_prefix_cache=False)
    assert got == want
    assert stats["recent_pages"] == 0  # cache off: every page went back with its request


def test_compact_under_retraction(tiny_v4_path, monkeypatch):
    want, _, _ = _run(tiny_v4_path, "per_token", monkeypatch, enable_prefix_cache=False)
    got, _, stats = _run(tiny_v4_path, "compact", monkeypatch, kv_cache_tokens=100, chunked_prefill_tokens=32)
    assert stats["retractions"] > 0
    assert got == want


def test_compact_prefix_hits_mid_window_cache_on_equals_off(tiny_v4_path, monkeypatch):
    off, _, _ = _run(tiny_v4_path, "compact", monkeypatch, rounds=2, enable_prefix_cache=False)
    on, cached, _ = _run(tiny_v4_path, "compact", monkeypatch, rounds=2, chunked_prefill_tokens=20,
                             checkpoint_tokens=12)
    assert on == off
    # Second round: a hit resumes at a checkpoint (a multiple of 12: mid-window of the ratio-8 layers) or
    # near the end of the first round's sequence, whose last R positions were kept.
    limits = [(len(p) + 2) // 4 * 4 for p in PROMPTS]
    assert all(c <= n and (c % 12 == 0 or c >= len(p) - 4) for c, n, p in zip(cached[1], limits, PROMPTS)), cached
    assert sum(c % 8 != 0 for c in cached[1]) >= 3 and sum(cached[1]) > 100, cached


def test_compact_prompt_logprobs_cut_a_hit_back_to_kept_state(tiny_v4_path, monkeypatch):
    """Prompt logprobs from position 30 on cut a 44-token hit back below 30: to where recent state was kept."""
    monkeypatch.setenv("DEEPINFER_V4_CHECKPOINT_TOKENS", "16")
    monkeypatch.setenv("DEEPINFER_V4_RELEASE_MARGIN", "0")
    prompt = PROMPTS[-1]
    scored = SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=True, logprob_start_len=30)
    results = []
    for cache in (True, False):
        with Engine(str(tiny_v4_path), dtype="float32", kv_cache_tokens=2048, page_size=4,
                    enable_prefix_cache=cache) as engine:
            engine.generate(input_ids=[prompt], sampling_params=GREEDY)
            (out,) = engine.generate(input_ids=[prompt], sampling_params=scored)
            results.append((out.token_ids, out.prompt_logprobs[30:], out.cached_tokens))
    (tokens_on, lp_on, cached), (tokens_off, lp_off, _) = results
    assert cached == 16  # 28 (the page below 30) has no recent state kept: back to the checkpoint at 16
    assert tokens_on == tokens_off
    assert lp_on == pytest.approx(lp_off, abs=1e-5)


def test_compact_n_siblings_fork_a_partly_filled_page(tiny_v4_path, monkeypatch):
    """n > 1 siblings share the leader's prompt pages and copy its partly filled last page (copy_slots)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5, n=3)
    prompts = [PROMPTS[5], PROMPTS[2]]  # 40 and 17 tokens: last pages partly filled at page_size 4
    results = []
    for layout in ("per_token", "compact"):
        monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", layout)
        with Engine(str(tiny_v4_path), dtype="float32", kv_cache_tokens=2048, page_size=4) as engine:
            results.append([o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)])
    assert results[0] == results[1]
    assert len(results[1]) == 6


def test_fp8_storage_accuracy_cost_vs_16_bit(tiny_v4_path):
    """kv_cache_dtype='fp8_e4m3': sliding keys and entries in FP8 (a scale per row). Its cost against bf16
    storage, on the tiny random model: prompt logprobs and greedy tokens (figures printed with -s)."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, prompt_logprobs=True)
    runs = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        with Engine(str(tiny_v4_path), dtype="bfloat16", kv_cache_tokens=2048, page_size=4,
                    kv_cache_dtype=kv_dtype) as engine:
            runs[kv_dtype] = engine.generate(input_ids=PROMPTS, sampling_params=params)
            if kv_dtype == "fp8_e4m3":
                assert engine.pool.fp8_swa[0] is not None and engine.pool.recent[0].shape[1] == 0
    diffs = [abs(a - b) for x, y in zip(runs["auto"], runs["fp8_e4m3"])
             for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
    same = sum(x.token_ids == y.token_ids for x, y in zip(runs["auto"], runs["fp8_e4m3"]))
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"fp8 vs bf16 storage: prompt logprob |diff| mean {mean:.4f} max {worst:.4f} nats; "
          f"greedy continuations equal {same}/{len(PROMPTS)}")
    assert 0 < mean < 0.1 and worst < 1.0
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(str(tiny_v4_path), dtype="float32", kv_cache_tokens=256, kv_cache_dtype="fp8_e5m2")


def test_v41_compact_equals_per_token_with_cut_back_hits(tiny_v41_paths, monkeypatch):
    """DeepSeek-V4.1 (ratios 0 / 1 / 2, shared KV sources, Engram ids) on the compact pool: the per-token layout's
    tokens, and cache on == off when hits are cut back to checkpoints; entries only on KV sources."""
    from test_deepseek_v41_engine import GREEDY as V41_GREEDY, PROMPTS as V41_PROMPTS

    path = tiny_v41_paths["a"]
    outs = {}
    for layout, cache in (("per_token", False), ("compact", False), ("compact", True)):
        monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", layout)
        monkeypatch.setenv("DEEPINFER_V4_CHECKPOINT_TOKENS", "12")
        monkeypatch.setenv("DEEPINFER_V4_RELEASE_MARGIN", "0")
        with Engine(str(path), dtype="float32", kv_cache_tokens=2048, page_size=2, chunked_prefill_tokens=9,
                    enable_prefix_cache=cache) as engine:
            first = engine.generate(input_ids=V41_PROMPTS, sampling_params=V41_GREEDY)
            again = engine.generate(input_ids=[p + o.token_ids[:2] for p, o in zip(V41_PROMPTS, first)],
                                    sampling_params=V41_GREEDY)
            outs[layout, cache] = [o.token_ids for o in first + again]
            if layout == "compact":
                v41 = engine.model.v41
                assert engine.pool.layout.ratios == tuple(s.ratio if s.is_kv_source else 0 for s in v41.layers)
                if cache:
                    assert sum(o.cached_tokens for o in again) > 0
    assert outs["compact", False] == outs["per_token", False] == outs["compact", True]
    monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", "per_token")  # FP8 rows: the compact pool's only
    with pytest.raises(ValueError, match="not supported"):
        Engine(str(path), dtype="float32", kv_cache_tokens=256, kv_cache_dtype="fp8_e4m3")
