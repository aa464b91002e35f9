"""DeepSeek-V4 against the transformers reference on tiny random checkpoints (CPU, fp32): logits through the KV
pool for prefill, mixed-length batches, chunks that do not align with compression windows, and decode.

Both variants hold sliding, CSA and HCA layers, hash_moe and moe layers, o_groups 2, a sliding window of 6 and
compression ratios 4 / 8; prompts span more than 4 windows of the larger ratio. The second variant
(test/conftest.py) has hc_mult 4, a YaRN compress rope and another layer order.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.models.deepseek_v4.common import PoolColumns, V4Config
from deepinfer_rt.models.loader import build_model, load_model_config
from helpers import assert_max_abs_close, scattered_slots
from helpers import forward_chunks as step
from helpers import prompt_tokens as prompt

ATOL = 1e-4
CPU = torch.device("cpu")
VARIANTS = {"hc2": "tiny_v4_path", "hc4-yarn": "tiny_v4_hc4_path"}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(VARIANTS[request.param])
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, CPU, seed=0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return config, model, ref


@torch.no_grad()
def hf_logits(ref, tokens: list[int]) -> torch.Tensor:
    return ref(torch.tensor([tokens])).logits[0].float()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_max_abs_close(got, want, ATOL)


def new_pool(model, config, num_slots: int = 400) -> KVPool:
    return KVPool(model.kv_layout(config), num_pages=num_slots, page_size=1, dtype=torch.float32, device=CPU)


def test_prefill_mixed_lengths_in_one_batch(models):
    config, model, ref = models
    prompts = [prompt(i, n) for i, n in enumerate((3, 11, 29, 37))]
    pool = new_pool(model, config)
    slots = [scattered_slots(pool, len(p), i) for i, p in enumerate(prompts)]
    outs = step(model, pool, [(p, s, 0, len(p)) for p, s in zip(prompts, slots)])
    for p, got in zip(prompts, outs):
        assert_close(got, hf_logits(ref, p))


@pytest.mark.parametrize("query_block", [256, 5])
def test_unaligned_chunks_and_decode_match_hf(models, query_block, monkeypatch):
    """Sequence a: chunks 0-5, 5-14, 14-27 (ratios 4 and 8 never divide a boundary but 0), then decode;
    sequence b, in the same batches: one 6-token chunk, then decode steps next to a's chunks. With
    query_block 5 a chunk's queries are also attended in several blocks."""
    config, model, ref = models
    monkeypatch.setattr(model.model, "query_block", query_block)
    a, b = prompt(10, 36), prompt(11, 30)
    want_a, want_b = hf_logits(ref, a), hf_logits(ref, b)
    pool = new_pool(model, config)
    slots_a, slots_b = scattered_slots(pool, len(a), 0), scattered_slots(pool, len(b), 1)
    pos_b = 0
    for start, end in [(0, 5), (5, 14), (14, 27)] + [(i, i + 1) for i in range(27, len(a))]:
        end_b = 6 if pos_b == 0 else pos_b + 1
        got_a, got_b = step(model, pool, [(a, slots_a, start, end), (b, slots_b, pos_b, end_b)])
        assert_close(got_a, want_a[start:end])
        assert_close(got_b, want_b[pos_b:end_b])
        pos_b = end_b
    assert pos_b == 6 + 2 + (len(a) - 27)


def test_kv_layout_per_layer_widths(models, monkeypatch):
    config, model, _ = models
    cfg = V4Config.from_model_config(config)
    monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", "per_token")
    layout = model.kv_layout(config)
    d, di = cfg.head_dim, cfg.index_head_dim
    widths = {"sliding_attention": d, "heavily_compressed_attention": 4 * d,
              "compressed_sparse_attention": 6 * d + 5 * di}
    assert layout.layer_dims == tuple(widths[t] for t in cfg.layer_types)
    assert layout.bytes_per_token(torch.float32) == 4 * sum(layout.layer_dims)
    assert all(PoolColumns.for_layer(cfg, t).width == w for t, w in widths.items())
    # Compact: per-token rows keep the sliding key and the compressor inputs, entries are rows of their own.
    monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", "compact")
    compact = model.kv_layout(config)
    recent = {"sliding_attention": d, "heavily_compressed_attention": 3 * d,
              "compressed_sparse_attention": 5 * d + 4 * di}
    entry = {"sliding_attention": 0, "heavily_compressed_attention": d, "compressed_sparse_attention": d + di}
    assert compact.layer_dims == tuple(recent[t] for t in cfg.layer_types)
    assert compact.entry_dims == tuple(entry[t] for t in cfg.layer_types)
    want = sum(entry[t] / cfg.ratio(t) for t in cfg.layer_types if cfg.ratio(t)) * 4
    assert compact.long_lived_bytes_per_token(torch.float32) == pytest.approx(want)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
    (dict(mlp_layer_types=["moe"] * 5), "mlp_layer_types has 5 entries"),
    (dict(layer_types=["sliding_attention", "dense", "sliding_attention", "sliding_attention"]), "entries must"),
    (dict(o_groups=3), "o_groups"),
    (dict(scoring_func="relu"), "scoring_func"),
])
def test_config_errors_are_clear(tiny_v4_path, change, message):
    config, _ = load_model_config(tiny_v4_path)
    bad = dataclasses.replace(config, raw={**config.raw, **change})
    with pytest.raises(ValueError, match=message):
        V4Config.from_model_config(bad)


@torch.no_grad()
def test_bf16_error_comparable_to_reference_bf16(tiny_v4_path):
    """In bfloat16 the fp32-kept parts (norm gains, sinks, position biases, hyper-connections, router bias) stay
    fp32 as in the reference, and our bf16 logits are about as far from the fp32 reference as transformers' bf16
    logits (RMS over 4 prompts; the max of single entries is too noisy to compare in bf16)."""
    from transformers import AutoModelForCausalLM

    config, _ = load_model_config(tiny_v4_path)
    model = build_model(config, tiny_v4_path, "auto", torch.bfloat16, CPU, seed=0)
    layer = model.model.layers[1]
    assert {p.dtype for p in (layer.hc_attn.fn, layer.attn.attn_sink, layer.attn.compressor.ape,
                               layer.attn.norm.weight, model.model.hc_head.hc_fn)} == {torch.float32}
    assert layer.attn.wqkv_a.weight.dtype == torch.bfloat16
    prompts = [prompt(i, 40) for i in range(4)]
    pool = KVPool(model.kv_layout(config), num_pages=200, page_size=1, dtype=torch.bfloat16, device=CPU)
    slots = torch.arange(160).view(4, 40)
    ours = torch.cat(step(model, pool, [(p, s, 0, 40) for p, s in zip(prompts, slots)]))
    refs = {dtype: AutoModelForCausalLM.from_pretrained(tiny_v4_path, dtype=dtype).eval()
            for dtype in (torch.float32, torch.bfloat16)}
    fp32, bf16 = (torch.cat([hf_logits(refs[dtype], p) for p in prompts]) for dtype in refs)
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    assert rms(ours - fp32) <= 2 * rms(bf16 - fp32)
