"""The block-scaled FP8 GEMM's paths side by side (deepinfer_kernels.fp8_gemm): today's fused Triton kernel (`triton`),
activations quantized once then the autotuned tiled Triton GEMM (`tiled`), the same activations into torch's
block-scaled scaled_mm (`scaled_mm`, cuBLASLt on SM90), and cuBLAS bf16 on the dequantized weight, at
DeepSeek-V2-Lite and full-width V3 projection shapes, M = 1 / 64 / 2048 / 8192 rows. Each row gives the time of
every path (CUDA-graph replays, so decode sizes are not launch-bound), its FLOP/s over the FP8 matmul rate measured
in the same run (torch._scaled_mm, 8192^3, tensor-wise scales) and the floor max(weight bytes / read bandwidth,
FLOPs / FP8 rate); a timed call cycles over copies of the weight that overflow L2 (L2_ROTATION_BYTES). At the end:
the per-M table this run's timings give (the path of least geometric-mean time over the shapes), the form of
fp8_gemm.AUTO_PATHS. auto_path's width rule (SPLIT_AUTO_MAX_N: the split fused kernel for narrow outputs at few rows)
is read from the per-shape rows and set by hand; the table alone would send every width to one path. `--grouped`:
the grouped GEMM (V4 / V4.1-Flash's wo_a, 8 groups of 1024 x 4096) beside cuBLAS bf16 on the dequantized weight.

    python benchmark/bench_fp8_gemm.py --out benchmark/results/gpu_fp8_gemm_h200.json     (H200, ~2 minutes)
    TRITON_INTERPRET=1 python benchmark/bench_fp8_gemm.py --device cpu --out /tmp/fp8_gemm_cpu.json   (smoke run)
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import triton

from deepinfer_kernels.fp8_gemm import (SPLIT_K_MAX_ROWS, TILED_K_STEP, _config, fp8_block_gemm, fp8_gemm,
                                        fp8_tiled_gemm, scaled_mm_shape_unsupported, scaled_mm_unsupported,
                                        split_k_for)
from deepinfer_kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv
from deepinfer_kernels.fp8_w16 import _w16_tuned
from deepinfer_kernels.fp8_quant import quantize_fp8_token_groups
from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

SHAPES = {  # (N, K)
    "v2lite_fused_qkv_a": (3072 + 576, 2048), "v2lite_dense_gate_up": (2 * 10944, 2048),
    "v2lite_dense_down": (2048, 10944), "v2lite_shared_gate_up": (2 * 2816, 2048),
    "v2lite_o_proj": (2048, 2048), "v2lite_shared_down": (2048, 2816),
    "v3_fused_qkv_a": (1536 + 576, 7168), "v3_q_b": (128 * 192, 1536), "v3_o_proj": (7168, 128 * 128),
    "v3_dense_gate_up": (2 * 18432, 7168), "v3_dense_down": (7168, 18432),
    # V4.1-Flash (32 x 32 scale blocks) and V4-Flash decode projections: wq_a, wq_b, wkv, wo_b, the shared expert
    "v41_wq_a": (1280, 5120, (32, 32)), "v41_wq_b": (64 * 512, 1280, (32, 32)), "v41_wkv": (512, 5120, (32, 32)),
    "v41_wo_b": (5120, 8192, (32, 32)), "v41_shared_gate_up": (2 * 2304, 5120, (32, 32)),
    "v41_shared_down": (5120, 2304, (32, 32)),
    "v4_wq_a": (1024, 4096), "v4_wq_b": (64 * 512, 1024), "v4_wo_b": (4096, 8192), "v4_shared_gate_up": (4096, 4096),
}
"""(N, K[, scale block]): 128 x 128 blocks unless given."""
GROUPED_SHAPES = {  # (groups, rows a group, inputs a group, scale block): V4 / V4.1-Flash's wo_a
    "v4flash_wo_a": (8, 1024, 4096, (128, 128)), "v41flash_wo_a": (8, 1024, 4096, (32, 32)),
}
ROWS = (1, 64, 2048, 8192)
FP8_PATHS = ("triton", "tiled", "scaled_mm")
SPLIT_PROBE_MAX_ROWS = 256
"""Row counts above fp8_gemm.SPLIT_K_MAX_ROWS up to this also time the fused kernel with K split (triton_split)."""


def _seconds(fn, device: str) -> float:
    """CUDA-graph replays on the GPU (fn runs once first: compiles and autotunes outside the capture), else the
    median of 3 wall-clock calls (the interpreter: a smoke run, no timing worth reading)."""
    fn()
    if device == "cuda":
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") / 1e3
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


CEILING_REPEATS = 3
"""Each ceiling is the best of this many timings: the first one of a fresh process can run at idle clocks (one H200
run read a copy at 2.77 TB/s, two thirds of the 4.2 its copies reach), and a low ceiling puts figures over it."""

L2_ROTATION_BYTES = 256 << 20
"""A timed call cycles over enough copies of the weight to read at least this many bytes (the H200's L2 holds
50 MB): a weight that fit in L2 would otherwise be read from it, not from DRAM, and beat its floor."""


def ceilings(device: str) -> dict:
    """Copy and read-only bytes/s, bf16 and FP8 matmul FLOP/s, measured now (each the best of CEILING_REPEATS).
    A GEMM's weight-streaming ceiling is the read-only one (`stream_bytes_per_s`, the larger of the two)."""
    numel, n = (1 << 29, 8192) if device == "cuda" else (1 << 20, 256)
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        return min(_seconds(fn, device) for _ in range(CEILING_REPEATS))

    copy_bw = 2 * numel * 2 / best(lambda: dst.copy_(src))
    read_bw = numel * 2 / best(lambda: src.sum(dtype=torch.float32))
    del dst
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = {"copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "stream_bytes_per_s": max(copy_bw, read_bw),
           "bf16_matmul_flop_per_s": 2 * n**3 / best(lambda: a @ a)}
    if device == "cuda":
        a8, one = a.to(torch.float8_e4m3fn), torch.ones((), device=device)
        out["fp8_matmul_flop_per_s"] = 2 * n**3 / best(
            lambda: torch._scaled_mm(a8, a8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    else:  # no FP8 matmul on CPU: the bf16 rate stands in, so the smoke run fills every field
        out["fp8_matmul_flop_per_s"] = out["bf16_matmul_flop_per_s"]
    return out


def gemm_rows(device: str, ceil: dict, shapes: dict, rows: tuple[int, ...], skip_scaled_mm: str | None,
              save) -> list:
    """One row per (shape, M); `save(rows so far)` after each, so a run cut short keeps what it measured."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter multiplies bf16 as integers
    out = []
    for name, (n, k, *block) in shapes.items():
        block = tuple(block[0]) if block else (128, 128)
        q, s = quantize_fp8_blocks(torch.randn(n, k, device=device) * 0.02, block)
        weight_bytes = q.numel() + s.numel() * 4
        copies = max(1, math.ceil(L2_ROTATION_BYTES / weight_bytes)) if device == "cuda" else 1
        fp8_weights = [(q.clone(), s.clone()) for _ in range(copies)]
        dense = [dequantize_fp8_blocks(wq, ws, block, dtype=dtype) for wq, ws in fp8_weights]

        def per_call(fn) -> float:  # one timed call runs every copy once
            return _seconds(lambda: [fn(i) for i in range(copies)], device) / copies

        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            flops = 2 * m * n * k
            row = {"shape": name, "m": m, "n": n, "k": k, "block": list(block), "weight_copies": copies,
                   "floor_us": 1e6 * max(weight_bytes / ceil["stream_bytes_per_s"],
                                         flops / ceil["fp8_matmul_flop_per_s"])}
            shape_reason = scaled_mm_shape_unsupported(n, k, *block, dtype)
            for path in FP8_PATHS:
                if path == "scaled_mm" and (skip_scaled_mm or shape_reason):
                    row["scaled_mm_skipped"] = skip_scaled_mm or f"{shape_reason} (the tiled path runs it)"
                    continue
                seconds = per_call(lambda i: fp8_gemm(x, *fp8_weights[i], *block, path=path))
                row[f"{path}_us"] = seconds * 1e6
                row[f"{path}_fraction_of_fp8_rate"] = flops / seconds / ceil["fp8_matmul_flop_per_s"]
                row[f"{path}_fraction_of_floor"] = row["floor_us"] / row[f"{path}_us"]
            if m > 1:  # W8A16: the weight tile dequantized in registers (deepinfer_kernels.fp8_w16)
                seconds = per_call(lambda i: fp8_gemm(x, *fp8_weights[i], *block, path="w16"))
                row["w16_us"] = seconds * 1e6
                row["w16_fraction_of_floor"] = row["floor_us"] / row["w16_us"]
                best = getattr(_w16_tuned, "best_config", None)  # the autotuner's pick for this shape
                if best is not None:
                    row["w16_tile"] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
                # the whole weight dequantized into scratch, then cuBLAS (deepinfer_kernels.fp8_dequant)
                seconds = per_call(lambda i: fp8_gemm(x, *fp8_weights[i], *block, path="dequant"))
                row["dequant_us"] = seconds * 1e6
                row["dequant_fraction_of_floor"] = row["floor_us"] / row["dequant_us"]
            if block[1] < TILED_K_STEP:  # the tiled kernel one narrow scale block a step (its form before)
                def one_block(i):
                    xq, xs = quantize_fp8_token_groups(x, block[1])
                    return fp8_tiled_gemm(xq, xs, m, *fp8_weights[i], *block, x.dtype, k_step=block[1])

                seconds = per_call(one_block)
                row["tiled_one_block_us"] = seconds * 1e6
                row["tiled_one_block_fraction_of_floor"] = row["floor_us"] / row["tiled_one_block_us"]
            if m <= GEMV_MAX_ROWS:  # the CUDA-core form for a few rows
                seconds = per_call(lambda i: fp8_gemv(x, *fp8_weights[i], *block))
                row["gemv_us"] = seconds * 1e6
                row["gemv_fraction_of_floor"] = row["floor_us"] / row["gemv_us"]
                # the activations quantized inside the GEMV kernel (one launch fewer; fp8_gemv.GEMV_QUANTIZE)
                seconds = per_call(lambda i: fp8_gemv(x, *fp8_weights[i], *block, quantize="kernel"))
                row["gemv_kernel_quant_us"] = seconds * 1e6
                row["gemv_kernel_quant_fraction_of_floor"] = row["floor_us"] / row["gemv_kernel_quant_us"]
            if device == "cuda" and SPLIT_K_MAX_ROWS < m <= SPLIT_PROBE_MAX_ROWS:
                # the split fused kernel past the row count where fp8_gemm stops splitting
                split = split_k_for(m, n, k, _config(m)["BLOCK_M"], _config(m)["BLOCK_N"], 128,
                                    torch.cuda.get_device_properties(device).multi_processor_count, max_rows=m)
                seconds = per_call(lambda i: fp8_block_gemm(x, *fp8_weights[i], *block, split_k=split))
                row.update(triton_split_k=split, triton_split_us=seconds * 1e6,
                           triton_split_fraction_of_floor=row["floor_us"] / (seconds * 1e6))
            seconds = per_call(lambda i: x @ dense[i].t())
            row["bf16_cublas_us"] = seconds * 1e6
            row["bf16_cublas_fraction_of_bf16_rate"] = flops / seconds / ceil["bf16_matmul_flop_per_s"]
            over = [path for path in (*FP8_PATHS, "triton_split", "gemv", "tiled_one_block", "w16", "dequant",
                                                  "gemv_kernel_quant")
                    if row.get(f"{path}_fraction_of_floor", 0) > 1.02]
            if over:  # a figure above the floor is a fault of this benchmark or of its floor, never a result
                row["above_floor"] = over
                print(f"WARNING: {name} M={m}: {over} above the floor", flush=True)
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
            out.append(row)
            save(out)
        del q, s, fp8_weights, dense
    return out


def grouped_rows(device: str, ceil: dict, rows: tuple[int, ...], save, out: list) -> list:
    """The grouped FP8 GEMM (`groups`, V4's wo_a kept in FP8) through `auto`, `triton`, `tiled` and (up to
    GEMV_MAX_ROWS rows) `gemv`, beside the form
    it replaces: cuBLAS bf16 over the weight dequantized at load (torch.einsum per group, twice the bytes)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for name, (groups, r, k, block) in GROUPED_SHAPES.items():
        q, s = quantize_fp8_blocks(torch.randn(groups * r, k, device=device) * 0.02, block)
        weight_bytes = q.numel() + s.numel() * 4
        copies = max(1, math.ceil(L2_ROTATION_BYTES / weight_bytes)) if device == "cuda" else 1
        fp8_weights = [(q.clone(), s.clone()) for _ in range(copies)]
        dense = [dequantize_fp8_blocks(wq, ws, block, dtype=dtype).view(groups, r, k) for wq, ws in fp8_weights]

        def per_call(fn) -> float:
            return _seconds(lambda: [fn(i) for i in range(copies)], device) / copies

        for m in rows:
            x = torch.randn(m, groups * k, device=device, dtype=dtype)
            flops = 2 * m * groups * r * k
            row = {"shape": name, "m": m, "groups": groups, "n": groups * r, "k": k, "block": list(block),
                   "weight_copies": copies, "floor_us": 1e6 * max(weight_bytes / ceil["stream_bytes_per_s"],
                                                                   flops / ceil["fp8_matmul_flop_per_s"])}
            for path in ("auto", "triton", "tiled") + (("gemv",) if m <= GEMV_MAX_ROWS else ()):
                seconds = per_call(lambda i: fp8_gemm(x, *fp8_weights[i], *block, path=path, groups=groups))
                row[f"grouped_{path}_us"] = seconds * 1e6
                row[f"grouped_{path}_fraction_of_floor"] = row["floor_us"] / row[f"grouped_{path}_us"]
            xg = x.view(m, groups, k)
            seconds = per_call(lambda i: torch.einsum("tgi,gri->tgr", xg, dense[i]))
            row["bf16_einsum_us"] = seconds * 1e6
            row["bf16_einsum_fraction_of_fp8_floor"] = row["floor_us"] / row["bf16_einsum_us"]
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
            out.append(row)
            save(out)
        del q, s, fp8_weights, dense
    return out


def auto_table(rows: list[dict]) -> list[tuple[int, str]]:
    """Per M, the FP8 path of least geometric-mean time over the shapes that every path ran (the scaled_mm rows
    where it was skipped for a shape count as the tiled path's, which runs them), merged into (largest M, path)
    rows in the form of fp8_gemm.AUTO_PATHS (the last row open-ended)."""
    best = []
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        means = {}
        for path in FP8_PATHS:
            times = [r.get(f"{path}_us", r.get("tiled_us")) if path == "scaled_mm" else r.get(f"{path}_us")
                     for r in at_m]
            if all(t is not None for t in times) and not (path == "scaled_mm" and all("scaled_mm_skipped" in r
                                                                                       for r in at_m)):
                means[path] = math.exp(sum(math.log(t) for t in times) / len(times))
        best.append((m, min(means, key=means.get)))
    table = []
    for m, path in best:
        if table and table[-1][1] == path:
            table[-1] = (m, path)
        else:
            table.append((m, path))
    return table[:-1] + [(1 << 62, table[-1][1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_fp8_gemm_h200.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="*", default=None, help=f"a subset of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default=None, help="row counts, comma-separated (default 1,64,2048,8192)")
    parser.add_argument("--grouped", action="store_true",
                        help="only the grouped GEMM (V4 / V4.1-Flash's wo_a) beside bf16 on the dequantized weight")
    args = parser.parse_args()
    if args.device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        shapes = {"tiny": (256, 256), "tiny_partial_n": (200, 384)}
        rows = (1, 16)
    else:
        unknown = set(args.shapes or ()) - set(SHAPES)
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}: choose from {', '.join(SHAPES)}")
        shapes = {k: SHAPES[k] for k in (args.shapes or SHAPES)}
        rows = ROWS
    if args.rows:
        rows = tuple(int(r) for r in args.rows.split(","))
    skip = scaled_mm_unsupported(torch.device(args.device))
    if skip:
        print(f"scaled_mm skipped: {skip}", flush=True)
    ceil = ceilings(args.device)
    print({k: f"{v:.3e}" for k, v in ceil.items()}, flush=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, **ceil, "scaled_mm_skipped": skip}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save(rows_so_far: list, key: str = "rows") -> None:
        result[key] = rows_so_far
        Path(args.out).write_text(json.dumps(result, indent=1))

    if args.grouped:
        if args.device == "cpu":
            GROUPED_SHAPES.clear()
            GROUPED_SHAPES.update(tiny_grouped=(2, 64, 256, (128, 128)), tiny_grouped_32=(3, 32, 64, (32, 32)))
        result["grouped_rows"] = grouped_rows(args.device, ceil, rows, lambda r: save(r, "grouped_rows"), [])
        return
    result["auto_paths"] = auto_table(gemm_rows(args.device, ceil, shapes, rows, skip, save))
    print(f"AUTO_PATHS from this run: {tuple(result['auto_paths'])}", flush=True)
    save(result["rows"])


if __name__ == "__main__":
    main()
