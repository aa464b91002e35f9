"""The FP8 fused MoE (deepinfer_kernels.fused_moe_fp8) beside the bf16 fused MoE on the same experts dequantized,
at V2-Lite's expert shapes (64 experts of 2048 x 1408, top-6, uniform routing), from CUDA graphs, in one run:

  bf16        fused_moe (autotuned) on the dequantized experts: the peer;
  fp8         fused_moe_fp8 as the engine calls it (activations quantized once, autotuned tiles);
  fp8 tiled   the same on experts reordered by tile_experts (contiguous 64 x 128 tiles; DEEPINFER_FP8_MOE_TILES);
  fp8 tiles   each of fused_moe_fp8.TUNE_CONFIGS fixed: what the autotuner chooses from;
  baseline    with --baseline FILE, a fused_moe_fp8 module loaded from that file (an earlier version).

Each timing replays a graph of `--copies` calls over as many copies of the experts, so no call finds its weights
in L2 from the one before. The floor is the touched experts' weight bytes (FP8: one byte a weight and the fp32
block scales) over the streaming bandwidth measured in the same run (bench_fp8_gemm.ceilings: the larger of the
copy and read-only rates, best of three; `fraction_of_floor`); the FLOP rate is also given beside the FP8 matmul
rate (torch._scaled_mm, 8192^3) of the same run. (results/gpu_moe_fp8_h100.json was measured against the copy rate.)

    python benchmark/bench_moe_fp8.py --out benchmark/results/gpu_moe_fp8_h200.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_gemm import ceilings  # noqa: E402
from bench_kernels import _graph_time  # noqa: E402

E, HIDDEN, INTER, TOPK = 64, 2048, 1408, 6


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_fused_moe_fp8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fused_moe_fp8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_moe_fp8_h200.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--baseline", default=None, help="a fused_moe_fp8 module file to time beside this one")
    parser.add_argument("--no-sweep", action="store_true", help="skip the fixed-tile rows")
    args = parser.parse_args()

    from deepinfer_kernels import fused_moe_fp8 as fm8
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "shape": dict(experts=E, hidden=HIDDEN, inter=INTER, top_k=TOPK),
              "ceilings": ceilings("cuda"), "rows": []}
    stream_bw = result["ceilings"]["stream_bytes_per_s"]
    print(result["ceilings"], flush=True)
    baseline = _load(args.baseline) if args.baseline else None
    g = torch.Generator(device="cuda").manual_seed(0)
    fp8, bf16, fp8_tiled = [], [], []
    for _ in range(args.copies):
        gate_up = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=g) * 0.02
        down = torch.randn(E, HIDDEN, INTER, device="cuda", generator=g) * 0.02
        (qg, sg), (qu, su) = quantize_fp8_blocks(gate_up[:, :INTER]), quantize_fp8_blocks(gate_up[:, INTER:])
        qd, sd = quantize_fp8_blocks(down)
        q_gu, s_gu = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
        fp8.append((q_gu, s_gu, qd, sd))
        fp8_tiled.append((fm8.tile_experts(q_gu, 128), s_gu, fm8.tile_experts(qd, 128), sd))
        bf16.append((dequantize_fp8_blocks(q_gu, s_gu, dtype=torch.bfloat16),
                     dequantize_fp8_blocks(qd, sd, dtype=torch.bfloat16)))
        del gate_up, down
    scale_bytes = (fp8[0][1][0].numel() + fp8[0][3][0].numel()) * 4
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for t in args.tokens:
        x = torch.randn(t, HIDDEN, device="cuda", generator=g).bfloat16()
        weights, ids = torch.rand(t, E, device="cuda", generator=g).topk(TOPK, dim=-1)
        touched = int(ids.unique().numel())
        fp8_bytes = touched * (3 * INTER * HIDDEN + scale_bytes)
        flops = 2 * t * TOPK * 3 * INTER * HIDDEN
        systems = {"bf16": lambda: [fused_moe(x, gu, d, weights, ids) for gu, d in bf16],
                   "fp8": lambda: [fm8.fused_moe_fp8(x, *w, weights, ids) for w in fp8],
                   "fp8 tiled": lambda: [fm8.fused_moe_fp8(x, *w, weights, ids, tiled=True) for w in fp8_tiled]}
        if baseline is not None:
            systems["fp8_baseline"] = lambda: [baseline(x, *w, weights, ids) for w in fp8]
        if not args.no_sweep:
            for bn, warps, stages in fm8.TUNE_CONFIGS:
                config = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
                systems[f"fp8 N{bn} w{warps} s{stages}"] = (
                    lambda config=config: [fm8.fused_moe_fp8(x, *w, weights, ids, config=config) for w in fp8])
        times = {}
        for name, fn in systems.items():
            try:
                times[name] = _graph_time(fn) / args.copies
            except Exception as exc:  # a fixed tile out of shared memory: not a candidate
                print(f"T={t} {name}: {type(exc).__name__}", flush=True)
                continue
            weight_bytes = touched * 3 * INTER * HIDDEN * 2 if name == "bf16" else fp8_bytes
            row = {"tokens": t, "system": name, "experts_touched": touched, "us": times[name] * 1e6,
                   "fraction_of_floor": weight_bytes / times[name] / stream_bw,
                   "fraction_of_fp8_matmul_rate": flops / times[name] / result["ceilings"]["fp8_matmul_flop_per_s"]}
            if "bf16" in times and name != "bf16":
                row["speedup_over_bf16"] = times["bf16"] / times[name]
            if name == "fp8 tiled" and "fp8" in times:
                row["speedup_over_fp8_rows"] = times["fp8"] / times[name]
                ref = fm8.fused_moe_fp8(x, *fp8[0], weights, ids)
                row["max_diff_vs_rows"] = (fm8.fused_moe_fp8(x, *fp8_tiled[0], weights, ids, tiled=True)
                                           - ref).abs().max().item()
            result["rows"].append(row)
            print(f"T={t:5d} {name:22s} {row['us']:9.1f} us  {row['fraction_of_floor']:.3f} of floor  "
                  f"{row['fraction_of_fp8_matmul_rate']:.3f} of fp8 rate"
                  + (f"  {row['speedup_over_bf16']:.2f}x bf16" if "speedup_over_bf16" in row else "")
                  + (f"  {row['speedup_over_fp8_rows']:.3f}x rows (max diff {row['max_diff_vs_rows']:.1e})"
                     if "speedup_over_fp8_rows" in row else ""), flush=True)
            out.write_text(json.dumps(result, indent=1))
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
