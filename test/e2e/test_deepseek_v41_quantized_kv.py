"""DeepSeek-V4.1 on its compact pool with 8- and 4-bit rows (CPU, torch forms).

- kv_cache_dtype='fp8_e4m3': sliding keys, the KV sources' entries and index keys as float8 e4m3 rows with an fp32
  scale per row. 'fp4_e2m1': the entries and index keys as MXFP4 rows (e2m1 + an e8m0 scale per 32 values,
  deepseek_v4/common.py Fp4Rows; the tiny configs' heads and index keys are 16 wide: a scale per 16 there), the
  sliding keys as under FP8. Both keep the compressor inputs and the Engram ids in the model dtype. Other layouts
  refuse 'fp4_e2m1' (test_fp4_is_refused_outside_v41).
- The pool's buffers hold those dtypes where they should (no 16-bit entry columns), and their bytes per token are
  the layout's figure, itself the one derived here from the config's widths.
- Against the 16-bit pool on both tiny configs (fp32, 4-token pages): prompt logprobs within 0.1 nats on average
  (1 at worst) under FP8 and 0.2 (1.5) under FP4; the first greedy token the same on at least 8 (FP8) / 4 (FP4) of the
  16 prompts over both configs (chance is ~1/20000 each). Measured (printed with -s): FP8 mean |diff| 0.050 ('a') and
  0.049 ('b') nats, max 0.64 / 0.43, first tokens equal on 4 + 6, whole 6-token continuations on 3 + 1; FP4 0.075 /
  0.101, max 0.69 / 0.70, first tokens 3 + 3, continuations 2 + 1. These random tiny models have flat logits, so
  rounding flips close calls often (and a continuation differs from its first flip on); an e2m1 value keeps one
  mantissa bit, so entries move more than under FP8.
- Prefix cache on == off in batch-invariant mode: token ids and logprobs bitwise, hits mid-window.
- DSpark: the drafter's context-key layer keeps its rows in the model dtype (it holds no sliding key and no entry),
  and greedy outputs with the drafter equal those without.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.cache import kv_pool
from deepinfer_rt.env import get_env
from deepinfer_rt.models.deepseek_v41.config import V41Config
from deepinfer_rt.models.loader import load_model_config
from test_deepseek_v41_engine import GREEDY, MAX_NEW, PROMPTS

pytestmark = pytest.mark.usefixtures("single_thread")

FP8, FP4 = "fp8_e4m3", "fp4_e2m1"
BOUNDS = {FP8: (0.1, 1.0, 8), FP4: (0.2, 1.5, 4)}
"""kv dtype -> (mean and worst |prompt logprob diff| in nats, first greedy tokens equal over both configs)."""


def _expected_bytes_per_token(path, kv_cache_dtype: str, size: int) -> int:
    """From the config: entries [D + Di] per `ratio` tokens on KV sources, recent rows [swa D | a ratio-2 source's
    kv D, gate D | ids 3] on a recent_fraction share of the tokens. FP8 stores the entry, index key and sliding key as
    a byte per value plus a 4-byte scale each, the rest in the model dtype; FP4 the entry and index key at half a
    byte per value and a byte per 32 values (per 16 where 32 won't do), the recent rows as FP8."""
    config, _ = load_model_config(path)
    cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
    d, di = cfg.head_dim, cfg.index_head_dim
    rest = [(2 * d if s.is_kv_source and s.ratio == 2 else 0) + (3 if s.engram_slot == 0 else 0) for s in cfg.layers]
    ratios = [s.ratio for s in cfg.layers if s.is_kv_source]
    if kv_cache_dtype == "auto":
        entry = (d + di) * size
        recent = (sum(rest) + len(cfg.layers) * d) * size
    else:
        fp4_scales = sum(w // (32 if w % 32 == 0 else 16) for w in (d, di))
        entry = d + 4 + di + 4 if kv_cache_dtype == FP8 else d // 2 + di // 2 + fp4_scales
        recent = sum(rest) * size + len(cfg.layers) * (d + 4)
    return math.ceil(sum(entry / m for m in ratios) + get_env().v4_recent_fraction * recent)


def _buffer_bytes(pool) -> tuple[float, int]:
    """(entry bytes per main-pool slot, bytes of one recent row over all layers), read off the pool's tensors (less
    each buffer's padding row)."""
    entry = recent = 0
    for layer in range(pool.layout.num_layers):
        rows = [r for r in (pool.fp8_entry[layer], pool.fp8_idx_entry[layer], pool.fp4_entry[layer],
                            pool.fp4_idx_entry[layer]) if r is not None]
        for t in [pool.entries[layer]] + [x for r in rows for x in (r.values, r.scales)]:
            entry += (t.shape[0] - 1) * t[0].numel() * t.element_size() if t.shape[0] else 0
        swa = pool.fp8_swa[layer]
        for t in [pool.recent[layer]] + ([] if swa is None else [swa.values, swa.scales]):
            recent += t[0].numel() * t.element_size()
    return entry / pool.num_slots, recent


def _check_pool(pool, kv_cache_dtype: str) -> None:
    """The buffers of each dtype where they belong."""
    sources = [i for i, m in enumerate(pool.layout.ratios) if m]
    assert sources
    if kv_cache_dtype == "auto":
        return
    assert all(f.values.dtype == torch.float8_e4m3fn for f in pool.fp8_swa)
    assert all(pool.entries[i].shape[1] == 0 for i in sources)
    if kv_cache_dtype == FP8:
        assert pool.layout.is_fp8
        assert all(pool.fp8_entry[i] is not None and pool.fp8_idx_entry[i] is not None for i in sources)
        return
    assert pool.layout.is_fp4 and all(pool.fp8_entry[i] is None for i in sources)
    for i in sources:
        for rows in (pool.fp4_entry[i], pool.fp4_idx_entry[i]):
            assert rows.values.dtype == rows.scales.dtype == torch.uint8
            assert rows.values.shape[1] * 2 == rows.block * rows.scales.shape[1]


@functools.cache
def _run(path, kv_cache_dtype: str):
    """Greedy outputs with prompt logprobs of PROMPTS, and the pool's bytes per token (fp32 model)."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, prompt_logprobs=True)
    # 4-token pages: a ratio-2 source then keeps one entry row per window (at 1-token pages, one per page)
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=kv_cache_dtype, page_size=4) as engine:
        pool = engine.pool
        _check_pool(pool, kv_cache_dtype)
        entry, recent = _buffer_bytes(pool)
        assert entry == pool.layout.long_lived_bytes_per_token(torch.float32)
        assert recent == pool.layout.recent_bytes_per_token(torch.float32)
        assert pool.layout.bytes_per_token(torch.float32) == _expected_bytes_per_token(path, kv_cache_dtype, 4)
        return engine.generate(input_ids=PROMPTS, sampling_params=params), pool.layout.bytes_per_token(torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", [FP8, FP4])
def test_pool_bytes_and_agreement_with_16_bit(tiny_v41_paths, kv_cache_dtype):
    assert kv_cache_dtype in kv_pool.KV_CACHE_DTYPES  # the engine takes the name as it is
    mean_bound, worst_bound, first_bound = BOUNDS[kv_cache_dtype]
    first_same = 0
    for variant, path in tiny_v41_paths.items():
        (plain, plain_bytes), (low, low_bytes) = _run(path, "auto"), _run(path, kv_cache_dtype)
        assert all(o.error is None and len(o.token_ids) == MAX_NEW for o in low)
        diffs = [abs(a - b) for x, y in zip(plain, low) for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
        mean, worst = sum(diffs) / len(diffs), max(diffs)
        first = sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(plain, low))
        whole = sum(x.token_ids == y.token_ids for x, y in zip(plain, low))
        print(f"V4.1 '{variant}' {kv_cache_dtype} vs 16-bit pool: {low_bytes} vs {plain_bytes} bytes per token (fp32 "
              f"model); prompt logprob |diff| mean {mean:.4f} max {worst:.4f} nats; first greedy token equal "
              f"{first}/{len(PROMPTS)}, whole continuations {whole}/{len(PROMPTS)}")
        assert low_bytes < plain_bytes
        assert 0 < mean < mean_bound and worst < worst_bound
        first_same += first
    assert first_same >= first_bound


def test_bf16_bytes_per_token(tiny_v41_paths):
    """In bf16 the FP8 pool's saving is the sliding keys' and entries' second byte, less their scales; FP4 saves
    more on the entries and index keys and keeps the recent rows of FP8."""
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    for path in tiny_v41_paths.values():
        config, _ = load_model_config(path)
        layout = DeepseekV41ForCausalLM.kv_layout(config)
        for kv in ("auto", FP8, FP4):
            assert layout.with_kv_dtype(kv).bytes_per_token(torch.bfloat16) == _expected_bytes_per_token(path, kv, 2)
        fp4, fp8 = layout.with_kv_dtype(FP4), layout.with_kv_dtype(FP8)
        assert fp8.bytes_per_token(torch.bfloat16) < layout.bytes_per_token(torch.bfloat16)
        assert fp4.long_lived_bytes_per_token(torch.bfloat16) < fp8.long_lived_bytes_per_token(torch.bfloat16)
        assert fp4.recent_bytes_per_token(torch.bfloat16) == fp8.recent_bytes_per_token(torch.bfloat16)


@pytest.mark.parametrize("kv_cache_dtype, variant", [(FP8, "a"), (FP4, "b")])
def test_prefix_cache_on_equals_off_bitwise(tiny_v41_paths, kv_cache_dtype, variant):
    """Batch-invariant mode (a row's numerics are its own): a second round of each prompt extended by its first 3
    tokens hits the cache mid-window; tokens and logprobs equal a cache-off engine's bit for bit."""
    path = tiny_v41_paths[variant]
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=kv_cache_dtype, batch_invariant=True,
              chunked_prefill_tokens=20)
    prompts = PROMPTS[3:7]
    with Engine(str(path), **kw) as engine:
        assert engine.pool.layout.is_fp4 == (kv_cache_dtype == FP4)
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        extended = [p + o.token_ids[:3] for p, o in zip(prompts, first)]
        on = engine.generate(input_ids=extended, sampling_params=params)
    assert all(o.cached_tokens > len(p) for o, p in zip(on, prompts))
    with Engine(str(path), enable_prefix_cache=False, **kw) as engine:
        off = engine.generate(input_ids=extended, sampling_params=params)
    assert [(o.token_ids, o.logprobs) for o in on] == [(o.token_ids, o.logprobs) for o in off]
    assert [o.token_ids for o in on] == [o.token_ids[3:] for o in first]


@pytest.mark.parametrize("kv_cache_dtype", [FP8, FP4])
def test_dspark_drafter(dspark_v41_path, kv_cache_dtype):
    kw = dict(dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=kv_cache_dtype)
    with Engine(str(dspark_v41_path), speculative="dspark", **kw) as engine:
        pool = engine.pool
        token_layer = pool.layout.num_layers - 1
        assert pool.layout.num_token_layers == 1 and pool.layout.is_fp4 == (kv_cache_dtype == FP4)
        assert pool.fp8_swa[token_layer] is None and pool.fp4_entry[token_layer] is None
        assert pool.recent[token_layer].shape[1] == pool.layout.layer_dims[token_layer]
        drafted = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)]
    with Engine(str(dspark_v41_path), **kw) as engine:
        plain = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)]
    assert drafted == plain


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_v3_path", "tiny_v4_path"])
def test_fp4_is_refused_outside_v41(fixture, request):
    """Only V4.1's compact pool stores MXFP4 rows: a plain K/V pool, MLA's latent pool and V4's compact pool refuse
    the name at start with the reason, instead of keeping their rows in another dtype."""
    with pytest.raises(ValueError, match="fp4_e2m1"):
        Engine(str(request.getfixturevalue(fixture)), dtype="float32", kv_cache_tokens=256, kv_cache_dtype=FP4)
