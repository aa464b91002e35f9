"""DeepSeek-V4.1 on its compact pool with kv_cache_dtype='fp8_e4m3' (CPU, torch forms): sliding keys, the KV sources'
entries and index keys stored as float8 e4m3 rows with an fp32 scale per row (the compressor inputs and the Engram ids
stay in the model dtype).

- The pool's buffers are FP8 where they should be, and their bytes per token are the layout's figure, which is the
  one derived here from the config's widths (16-bit and FP8).
- Against the 16-bit pool on both tiny configs (fp32, 4-token pages): prompt logprobs within 0.1 nats on average
  (1 nat at worst) and the first greedy token the same on at least half of the 16 prompts (floor 8; chance is
  ~1/20000). Measured: mean |diff| 0.050 ('a') and 0.049 ('b') nats, max 0.64 / 0.43; first tokens equal on 4 + 6 of
  16, whole 6-token continuations on 3 + 1 (printed with -s). These random tiny models have flat logits, so FP8
  rounding flips close calls often (and a continuation differs from its first flip on); the logprob bound is the
  cost.
- Prefix cache on == off in batch-invariant mode with FP8 rows: token ids and logprobs bitwise, hits mid-window.
- DSpark's context-key layer stays in the model dtype under FP8 (it holds no sliding key), and greedy outputs with
  the drafter equal those without on the FP8 pool.
"""
from __future__ import annotations

import math

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.env import get_env
from deepinfer_rt.models.deepseek_v41.config import V41Config
from deepinfer_rt.models.loader import load_model_config
from test_deepseek_v41_engine import GREEDY, MAX_NEW, PROMPTS

pytestmark = pytest.mark.usefixtures("single_thread")

FP8 = "fp8_e4m3"


def _expected_bytes_per_token(path, kv_cache_dtype: str, size: int) -> int:
    """From the config: entries [D + Di] per `ratio` tokens on KV sources, recent rows [swa D | a ratio-2 source's
    kv D, gate D | ids 3] on a recent_fraction share of the tokens; FP8 stores the entry, index key and sliding key
    as a byte per value plus a 4-byte scale each, the rest in the model dtype."""
    config, _ = load_model_config(path)
    cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
    d, di = cfg.head_dim, cfg.index_head_dim
    rest = [(2 * d if s.is_kv_source and s.ratio == 2 else 0) + (3 if s.engram_slot == 0 else 0) for s in cfg.layers]
    sources = [s.ratio for s in cfg.layers if s.is_kv_source]
    if kv_cache_dtype == FP8:
        long_lived = sum((d + 4 + di + 4) / m for m in sources)
        recent = sum(rest) * size + len(cfg.layers) * (d + 4)
    else:
        long_lived = sum((d + di) * size / m for m in sources)
        recent = (sum(rest) + len(cfg.layers) * d) * size
    return math.ceil(long_lived + get_env().v4_recent_fraction * recent)


def _buffer_bytes(pool) -> tuple[float, int]:
    """(entry bytes per main-pool slot, bytes of one recent row over all layers), read off the pool's tensors
    (less each buffer's padding row)."""
    entry = recent = 0
    for layer in range(pool.layout.num_layers):
        fp8 = [f for f in (pool.fp8_entry[layer], pool.fp8_idx_entry[layer]) if f is not None]
        for t in [pool.entries[layer]] + [x for f in fp8 for x in (f.values, f.scales)]:
            entry += (t.shape[0] - 1) * t[0].numel() * t.element_size() if t.shape[0] else 0
        swa = pool.fp8_swa[layer]
        for t in [pool.recent[layer]] + ([] if swa is None else [swa.values, swa.scales]):
            recent += t[0].numel() * t.element_size()
    return entry / pool.num_slots, recent


def _run(path, kv_cache_dtype, **kw):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, prompt_logprobs=True)
    # 4-token pages: a ratio-2 source then keeps one entry row per window (at 1-token pages, one per page)
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=kv_cache_dtype, page_size=4,
                **kw) as engine:
        pool = engine.pool
        if kv_cache_dtype == FP8:
            assert pool.layout.is_fp8 and all(f.values.dtype == torch.float8_e4m3fn for f in pool.fp8_swa)
            sources = [i for i, m in enumerate(pool.layout.ratios) if m]
            assert sources and all(pool.entries[i].shape[1] == 0 for i in sources)
            assert all(pool.fp8_entry[i] is not None and pool.fp8_idx_entry[i] is not None for i in sources)
        entry, recent = _buffer_bytes(pool)
        assert entry == pool.layout.long_lived_bytes_per_token(torch.float32)
        assert recent == pool.layout.recent_bytes_per_token(torch.float32)
        assert pool.layout.bytes_per_token(torch.float32) == _expected_bytes_per_token(path, kv_cache_dtype, 4)
        return engine.generate(input_ids=PROMPTS, sampling_params=params), pool.layout.bytes_per_token(torch.float32)


def test_fp8_pool_bytes_and_agreement_with_16_bit(tiny_v41_paths):
    first_same = 0
    for variant, path in tiny_v41_paths.items():
        (plain, plain_bytes), (fp8, fp8_bytes) = _run(path, "auto"), _run(path, FP8)
        assert all(o.error is None and len(o.token_ids) == MAX_NEW for o in fp8)
        diffs = [abs(a - b) for x, y in zip(plain, fp8) for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])]
        mean, worst = sum(diffs) / len(diffs), max(diffs)
        first = sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(plain, fp8))
        whole = sum(x.token_ids == y.token_ids for x, y in zip(plain, fp8))
        print(f"V4.1 '{variant}' FP8 vs 16-bit pool: {fp8_bytes} vs {plain_bytes} bytes per token (fp32 model); "
              f"prompt logprob |diff| mean {mean:.4f} max {worst:.4f} nats; first greedy token equal "
              f"{first}/{len(PROMPTS)}, whole continuations {whole}/{len(PROMPTS)}")
        assert fp8_bytes < plain_bytes
        assert 0 < mean < 0.1 and worst < 1.0
        first_same += first
    assert first_same >= 8


def test_fp8_bf16_bytes_per_token(tiny_v41_paths):
    """In bf16 the FP8 pool's saving is the sliding keys' and entries' second byte, less their scales."""
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    for path in tiny_v41_paths.values():
        config, _ = load_model_config(path)
        layout = DeepseekV41ForCausalLM.kv_layout(config)
        for kv in ("auto", FP8):
            got = layout.with_kv_dtype(kv).bytes_per_token(torch.bfloat16)
            assert got == _expected_bytes_per_token(path, kv, 2)
        assert layout.with_kv_dtype(FP8).bytes_per_token(torch.bfloat16) < layout.bytes_per_token(torch.bfloat16)


def test_fp8_prefix_cache_on_equals_off_bitwise(tiny_v41_paths):
    """Batch-invariant mode (a row's numerics are its own), FP8 rows: a second round of each prompt extended by its
    first 3 tokens hits the cache mid-window; tokens and logprobs equal a cache-off engine's bit for bit."""
    path = tiny_v41_paths["a"]
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=FP8, batch_invariant=True,
              chunked_prefill_tokens=20)
    prompts = PROMPTS[3:7]
    with Engine(str(path), **kw) as engine:
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        extended = [p + o.token_ids[:3] for p, o in zip(prompts, first)]
        on = engine.generate(input_ids=extended, sampling_params=params)
    assert all(o.cached_tokens > len(p) for o, p in zip(on, prompts))
    with Engine(str(path), enable_prefix_cache=False, **kw) as engine:
        off = engine.generate(input_ids=extended, sampling_params=params)
    assert [(o.token_ids, o.logprobs) for o in on] == [(o.token_ids, o.logprobs) for o in off]
    assert [o.token_ids for o in on] == [o.token_ids[3:] for o in first]


def test_fp8_with_dspark_drafter(dspark_v41_path):
    with Engine(str(dspark_v41_path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=FP8,
                speculative="dspark") as engine:
        pool = engine.pool
        token_layer = pool.layout.num_layers - 1
        assert pool.layout.num_token_layers == 1 and pool.fp8_swa[token_layer] is None
        assert pool.recent[token_layer].shape[1] == pool.layout.layer_dims[token_layer]
        drafted = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)]
    with Engine(str(dspark_v41_path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype=FP8) as engine:
        plain = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4], sampling_params=GREEDY)]
    assert drafted == plain
