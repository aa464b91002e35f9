"""MLA decode attention over an FP8 (e4m3) KV pool beside the bf16 pool, on the GPU: DeepSeek-V2-Lite's 16 heads
and V3's 128 over the 512 + 64 latent, page size 1 as the engine's pool lays a sequence out, CUDA-graph replays.
Each row is the kernel's time and its KV bytes (e4m3 values and the float32 row scales, or bf16 values) over the
copy bandwidth measured in the same run. The FP8 rows compare the dots' operand dtypes
(`paged_decode_attention(kv_dot=...)`: the query's bf16, or fp16) and the tile sizes around the engine's choice.

    python benchmark/bench_kv8_decode.py --out benchmark/results/gpu_kv8_decode_h200.json
    STAGES=kv8 bash scripts/gpu_check.sh                          # the same, on the GPU machine
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

from bench_kernels import _graph_time, ceilings
from deepinfer_kernels.decode_attention import num_splits_for, paged_decode_attention
from deepinfer_rt.cache.kv_pool import quantize_fp8_rows


def kv8_rows(context: int, batches: tuple[int, ...], copy_bw: float) -> list[dict]:
    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for heads, batch in itertools.product((16, 128), batches):
        if heads == 128 and batch not in (1, 64):
            continue
        k = torch.randn(batch * context, 1, 576, dtype=torch.bfloat16, device="cuda")
        k8, scale = quantize_fp8_rows(k)
        table = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device="cuda")
        rows_ = torch.arange(batch, dtype=torch.int32, device="cuda")
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        splits = num_splits_for(batch, 1, num_sms, 576)
        ref = paged_decode_attention(q, k, k[..., :512], table, rows_, lens, 1, 0.1, splits).float()
        variants = [("bf16", "query", None, None, 4)]
        variants += [("fp8", dot, None, None, 4) for dot in ("query", "f16")]
        # a converted tile passes through registers (8 warps halve a thread's share of it)
        variants += [("fp8", dot, bn, 2, w) for dot, (bn, w) in itertools.product(
            ("query", "f16"), ((32, 4), (32, 8), (64, 4), (64, 8), (128, 8)))]
        for kv, dot, block_n, stages, warps in variants:
            args = ((k, k[..., :512]) if kv == "bf16" else (k8, k8[..., :512]))
            extra = {} if kv == "bf16" else dict(k_scale=scale, v_scale=scale, kv_dot=dot)
            def fn(args=args, extra=extra, block_n=block_n, stages=stages, warps=warps):
                return paged_decode_attention(q, *args, table, rows_, lens, 1, 0.1, splits, block_n=block_n,
                                              num_stages=stages, num_warps=warps, **extra)
            try:
                err = (fn().float() - ref).abs().max().item()
                s = _graph_time(fn)
            except triton.runtime.errors.OutOfResources:
                continue  # the tile does not fit shared memory at this depth
            nbytes = batch * context * (576 * 2 if kv == "bf16" else 576 + 4)
            rows.append({"heads": heads, "batch": batch, "context": context, "kv": kv, "kv_dot": dot,
                         "block_n": block_n, "num_stages": stages, "num_warps": warps,
                         "engine_choice": block_n is None,
                         "splits": splits, "us": s * 1e6, "fraction_of_copy_bw": nbytes / s / copy_bw,
                         "max_abs_diff_vs_bf16_kv": err})
            print(f"H{heads} B{batch} {kv} dot={dot} block_n={block_n} stages={stages} warps={warps}: "
                  f"{s * 1e6:8.1f} us {rows[-1]['fraction_of_copy_bw']:.3f} of copy bw, |d| {err:.3g}", flush=True)
        del k, k8, scale, table
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_kv8_decode_h200.json")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    copy_bw, mm_rate = ceilings("cuda", 1 << 29)
    rows = kv8_rows(args.context, tuple(args.batches), copy_bw)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw,
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
