"""DeepSeek-V4.1 on its compact pool with kv_cache_dtype='fp4_e2m1' (CPU, torch forms): the KV sources' entries and
index keys as MXFP4 rows (e2m1 + an e8m0 scale per 32, deepseek_v4/common.py Fp4Rows), the sliding keys as the FP8
rows of 'fp8_e4m3', the compressor inputs and the Engram ids in the model dtype.

Other layouts refuse 'fp4_e2m1' (test_fp4_is_refused_outside_v41).

- The tiny configs' heads and index keys are 16 wide: a scale per 16 values there (common.py fp4_block), per 32 elsewhere.
- The pool's buffers are MXFP4 where they should be (uint8 values and scales, no FP8 or 16-bit entry columns) and
  their bytes per token are the layout's figure, itself the one derived here from the config's widths.
- Against the 16-bit pool on both tiny configs (fp32, 4-token pages): prompt logprobs within 0.2 nats on average
  (1.5 at worst) and the first greedy token the same on at least 4 of the 16 prompts (chance is ~1/20000 each).
  Measured (printed with -s): mean |diff| 0.075 ('a') and 0.101 ('b') nats, max 0.69 / 0.70; first tokens equal on
  3 + 3 of 16, whole 6-token continuations on 2 + 1 (FP8: 0.050 / 0.049 mean, 4 + 6 first tokens). An e2m1 value
  keeps one mantissa bit, so entries move more than under FP8; the sliding keys are FP8 in both.
- Prefix cache on == off in batch-invariant mode with MXFP4 rows: token ids and logprobs bitwise, hits mid-window.
- DSpark: greedy outputs with the drafter equal those without on the MXFP4-entry pool.
"""
from __future__ import annotations

import math

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.cache import kv_pool
from deepinfer_rt.env import get_env
from deepinfer_rt.models.deepseek_v41.config import V41Config
from deepinfer_rt.models.loader import load_model_config
from test_deepseek_v41_engine import GREEDY, MAX_NEW, PROMPTS

pytestmark = pytest.mark.usefixtures("single_thread", "fp4_engines")

FP4 = "fp4_e2m1"
MEAN_BOUND, WORST_BOUND = 0.2, 1.5


@pytest.fixture
def fp4_engines():
    """The engine takes the name as it is (cache/kv_pool.py KV_CACHE_DTYPES)."""
    assert FP4 in kv_pool.KV_CACHE_DTYPES


def _fp4_bytes_per_token(path, size: int) -> int:
    """From the config: entries and index keys at half a byte per value and a byte per 32 values on KV sources (per
    `ratio` tokens), recent rows as under FP8 (sliding keys a byte per value and a 4-byte scale, a ratio-2 source's
    kv / gate and the ids in the model dtype) on a recent_fraction share of the tokens."""
    config, _ = load_model_config(path)
    cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
    d, di = cfg.head_dim, cfg.index_head_dim
    rest = [(2 * d if s.is_kv_source and s.ratio == 2 else 0) + (3 if s.engram_slot == 0 else 0) for s in cfg.layers]
    scale_bytes = sum(w // (32 if w % 32 == 0 else 16) for w in (d, di))  # a scale per 32 values, per 16 if 32 won't do
    long_lived = sum((d // 2 + di // 2 + scale_bytes) / s.ratio for s in cfg.layers if s.is_kv_source)
    recent = sum(rest) * size + len(cfg.layers) * (d + 4)
    return math.ceil(long_lived + get_env().v4_recent_fraction * recent)


def _run(path, kv_cache_dtype, **kw):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=kv_cache_dtype, page_size=4,
                **kw) as engine:
        pool = engine.pool
        if kv_cache_dtype == FP4:
            sources = [i for i, m in enumerate(pool.layout.ratios) if m]
            assert pool.layout.is_fp4 and sources and all(f.values.dtype == torch.float8_e4m3fn for f in pool.fp8_swa)
            assert all(pool.entries[i].shape[1] == 0 and pool.fp8_entry[i] is None for i in sources)
            for i in sources:
                for rows in (pool.fp4_entry[i], pool.fp4_idx_entry[i]):
                    assert rows.values.dtype == rows.scales.dtype == torch.uint8
                    assert rows.values.shape[1] * 2 == rows.block * rows.scales.shape[1]
            entry = sum((t.shape[0] - 1) * t[0].numel() for i in sources
                        for r in (pool.fp4_entry[i], pool.fp4_idx_entry[i]) for t in (r.values, r.scales))
            assert entry / pool.num_slots == pool.layout.long_lived_bytes_per_token(torch.float32)
            assert pool.layout.bytes_per_token(torch.float32) == _fp4_bytes_per_token(path, 4)
        return engine.generate(input_ids=PROMPTS, sampling_params=params), pool.layout.bytes_per_token(torch.float32)


def test_fp4_pool_bytes_and_agreement_with_16_bit(tiny_v41_paths):
    first_same = 0
    for variant, path in tiny_v41_paths.items():
        (plain, plain_bytes), (fp4, fp4_bytes) = _run(path, "auto"), _run(path, FP4)
        assert all(o.error is None and len(o.token_ids) == MAX_NEW for o in fp4)
        diffs = [abs(a - b) for x, y in zip(plain, fp4) for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
        mean, worst = sum(diffs) / len(diffs), max(diffs)
        first = sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(plain, fp4))
        whole = sum(x.token_ids == y.token_ids for x, y in zip(plain, fp4))
        print(f"V4.1 '{variant}' FP4 vs 16-bit pool: {fp4_bytes} vs {plain_bytes} bytes per token (fp32 model); "
              f"prompt logprob |diff| mean {mean:.4f} max {worst:.4f} nats; first greedy token equal "
              f"{first}/{len(PROMPTS)}, whole continuations {whole}/{len(PROMPTS)}")
        assert fp4_bytes < plain_bytes
        assert 0 < mean < MEAN_BOUND and worst < WORST_BOUND
        first_same += first
    assert first_same >= 4


def test_fp4_bf16_bytes_per_token(tiny_v41_paths):
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    for path in tiny_v41_paths.values():
        config, _ = load_model_config(path)
        layout = DeepseekV41ForCausalLM.kv_layout(config)
        fp4, fp8 = layout.with_kv_dtype(FP4), layout.with_kv_dtype("fp8_e4m3")
        assert fp4.bytes_per_token(torch.bfloat16) == _fp4_bytes_per_token(path, 2)
        assert fp4.long_lived_bytes_per_token(torch.bfloat16) < fp8.long_lived_bytes_per_token(torch.bfloat16)
        assert fp4.recent_bytes_per_token(torch.bfloat16) == fp8.recent_bytes_per_token(torch.bfloat16)


def test_fp4_prefix_cache_on_equals_off_bitwise(tiny_v41_paths):
    """Batch-invariant mode, MXFP4 entries: a second round of each prompt extended by its first 3 tokens hits the
    cache mid-window; tokens and logprobs equal a cache-off engine's bit for bit."""
    path = tiny_v41_paths["b"]
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=FP4, batch_invariant=True,
              chunked_prefill_tokens=20)
    prompts = PROMPTS[3:7]
    with Engine(str(path), **kw) as engine:
        assert engine.pool.layout.is_fp4
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        extended = [p + o.token_ids[:3] for p, o in zip(prompts, first)]
        on = engine.generate(input_ids=extended, sampling_params=params)
    assert all(o.cached_tokens > len(p) for o, p in zip(on, prompts))
    with Engine(str(path), enable_prefix_cache=False, **kw) as engine:
        off = engine.generate(input_ids=extended, sampling_params=params)
    assert [(o.token_ids, o.logprobs) for o in on] == [(o.token_ids, o.logprobs) for o in off]
    assert [o.token_ids for o in on] == [o.token_ids[3:] for o in first]


def test_fp4_with_dspark_drafter(dspark_v41_path):
    """The drafter's context-key layer keeps its rows in the model dtype (no entries, no sliding key), and greedy
    outputs with the drafter equal those without on the MXFP4-entry pool."""
    with Engine(str(dspark_v41_path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=FP4,
                speculative="dspark") as engine:
        pool = engine.pool
        token_layer = pool.layout.num_layers - 1
        assert pool.layout.is_fp4 and pool.layout.num_token_layers == 1
        assert pool.fp8_swa[token_layer] is None and pool.fp4_entry[token_layer] is None
        drafted = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)]
    with Engine(str(dspark_v41_path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=FP4) as engine:
        plain = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)]
    assert drafted == plain


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_v3_path", "tiny_v4_path"])
def test_fp4_is_refused_outside_v41(fixture, request):
    """Only V4.1's compact pool stores MXFP4 rows: a plain K/V pool, MLA's latent pool and V4's compact pool refuse
    the name at start with the reason, instead of keeping their rows in another dtype."""
    with pytest.raises(ValueError, match="fp4_e2m1"):
        Engine(str(request.getfixturevalue(fixture)), dtype="float32", kv_cache_tokens=256, kv_cache_dtype=FP4)
