"""DeepSeek-V4 decode cost beside a plain-MLA model of the same width, in one run.

    python benchmark/bench_v4.py [--layers 3] [--experts 8] [--vocab 16384] [--batch 4] [--context 2048]

Both models come from config alone (load_format="dummy"): V4 from the published V4-Flash config shipped in
deepinfer_rt/models/configs/deepseek-v4-flash, layer-reduced to one sliding, one CSA and one HCA layer (then
repeating); the peer is a DeepSeek-V3-style MLA model with the same hidden size, heads, q/kv ranks, MoE width
and layer count. Routed experts and vocabulary are cut (flags) so both fit a small machine; attention, the part
that differs, keeps its full width.

Reports the full V4-Flash parameter count (built on the meta device, no memory), the reduced models' parameter
count and bytes, KV-pool bytes stored per token of each (bf16), the KV bytes a decode token must read at
`context` (the architecture's floor), and the decode step time per layer at `batch` sequences of `context`
tokens through the torch reference path. The pool is filled with random state instead of a prefill: decode cost does not
depend on the values, and a CPU prefill of the context would dominate the run. Writes
benchmark/results/v4_<device>.json.
"""
from __future__ import annotations

import argparse
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
from deepinfer_rt.models.deepseek_v4.common import CSA, V4Config
from deepinfer_rt.models.loader import build_model, load_model_config

FLASH = Path(__file__).resolve().parents[1] / "deepinfer_rt" / "models" / "configs" / "deepseek-v4-flash"
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


def attended_kv_bytes(config: ModelConfig, context: int) -> int:
    """KV bytes (bf16) one decode token must read at `context` tokens: the architecture's floor, whatever the
    kernel. V4: the sliding window in every layer, plus all indexer keys and the top-k entries in CSA layers,
    plus all entries in HCA layers. MLA: the latent and rope key of every position in every layer."""
    if config.architecture != "DeepseekV4ForCausalLM":
        return 2 * context * (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_layers
    cfg = V4Config.from_model_config(config)
    elems = 0
    for layer_type in cfg.layer_types:
        elems += min(cfg.sliding_window, context) * cfg.head_dim
        m = cfg.ratio(layer_type)
        if m and layer_type == CSA:
            elems += (context // m) * cfg.index_head_dim + min(cfg.index_topk, context // m) * cfg.head_dim
        elif m:
            elems += (context // m) * cfg.head_dim
    return 2 * elems


def full_flash_params() -> int:
    from deepinfer_rt.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config, _ = load_model_config(FLASH)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    return sum(p.numel() for p in model.parameters() if p.is_floating_point())


@torch.no_grad()
def decode_step_seconds(model, config: ModelConfig, args, device: torch.device) -> list[float]:
    layout = model.kv_layout(config)
    ctx, batch = args.context, args.batch
    pool = KVPool(layout, num_pages=batch * (ctx + 1), page_size=1, dtype=args.dtype, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for buf in pool.k:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    slots = torch.arange(batch * (ctx + 1), device=device).view(batch, ctx + 1)
    backend = TorchRefBackend()
    times = []
    for _ in range(args.repeats):
        fb = ForwardBatch(
            input_ids=torch.randint(0, config.vocab_size, (batch,), generator=gen).to(device),
            positions=torch.full((batch,), ctx, device=device), out_slots=slots[:, ctx].contiguous(),
            q_lens=[1] * batch, kv_lens=[ctx + 1] * batch, kv_slots=list(slots), pool=pool, backend=backend)
        backend.prepare(fb)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model.prepare_batch(fb)  # the step's V4 indices, host work every step
        model.compute_logits(model(fb))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[1:]  # the first step warms up


def measure(name: str, config: ModelConfig, args, device: torch.device) -> dict:
    model = build_model(config, None, "dummy", args.dtype, device, seed=0)
    params = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = model.kv_layout(config).bytes_per_token(torch.bfloat16)
    attended = attended_kv_bytes(config, args.context)
    times = decode_step_seconds(model, config, args, device)
    del model
    step = statistics.median(times)
    row = dict(params=params, weight_bytes=weight_bytes, kv_bytes_per_token_bf16=kv_bytes,
               attended_kv_bytes_per_decode_token_bf16=attended,
               decode_step_s_median=step, decode_step_s_spread=[min(times), max(times)],
               decode_step_per_layer_ms=1e3 * step / config.num_layers)
    print(f"{name:4s} params {params / 1e9:.2f}B ({weight_bytes / 2**30:.1f} GiB)  KV stored {kv_bytes} B/token, "
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
    v4 = v4_config(args)
    rows = {"v4": measure("v4", v4, args, device), "mla": measure("mla", mla_config(v4), args, device)}
    ratios = {"kv_bytes_v4_over_mla": rows["v4"]["kv_bytes_per_token_bf16"] / rows["mla"]["kv_bytes_per_token_bf16"],
              "attended_kv_v4_over_mla": (rows["v4"]["attended_kv_bytes_per_decode_token_bf16"]
                                          / rows["mla"]["attended_kv_bytes_per_decode_token_bf16"]),
              "decode_step_v4_over_mla": rows["v4"]["decode_step_s_median"] / rows["mla"]["decode_step_s_median"]}
    print("ratios v4 / mla:", {k: round(v, 2) for k, v in ratios.items()})
    out = Path(__file__).resolve().parent / "results" / f"v4_{device.type}.json"
    out.write_text(json.dumps(dict(
        full_v4_flash_params=flash, machine=platform.processor() or platform.machine(),
        torch_threads=torch.get_num_threads(), args={k: str(v) for k, v in vars(args).items()},
        results=rows, ratios=ratios), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
