"""Kernel timings at DeepSeek-V2-Lite decode shapes (one layer, 2K context), as achieved bytes/s over the bytes
each kernel must read, beside the device copy bandwidth measured in the same run. Variants of the decode
attention's tile (BLOCK_N) and warps show which to use.

    python benchmark/bench_kernels.py --out benchmark/results/gpu_kernels_h200.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from deepinfer_kernels.decode_attention import num_splits_for, paged_decode_attention
from deepinfer_kernels.fused_moe import fused_moe


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def attention_rows(context: int, num_sms: int) -> list[dict]:
    rows = []
    for batch in (1, 64, 256):
        k = torch.randn(batch * context, 1, 576, dtype=torch.bfloat16, device="cuda")
        table = torch.randperm(batch * context, device="cuda").view(batch, context).to(torch.int32)
        q = torch.randn(batch, 16, 576, dtype=torch.bfloat16, device="cuda")
        rows_ = torch.arange(batch, dtype=torch.int32, device="cuda")
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        default_splits = num_splits_for(batch, 1, num_sms)
        for splits, block_n, warps in [(default_splits, bn, w) for bn in (16, 32, 64) for w in (4, 8)] + \
                [(n, bn, 4) for n in (2 * default_splits, 4 * default_splits) for bn in (16, 32) if batch < 64]:
            s = _time(lambda: paged_decode_attention(q, k, k[..., :512], table, rows_, lens, 1, 0.1, splits,
                                                     block_n=block_n, num_warps=warps))
            rows.append({"kernel": "mla_decode", "batch": batch, "block_n": block_n, "num_warps": warps,
                         "splits": splits, "us": s * 1e6, "bytes_per_s": k.numel() * 2 / s})
        del k, table
    return rows


def moe_rows() -> list[dict]:
    rows = []
    e, hidden, inter, topk = 64, 2048, 1408, 6
    gate_up = torch.randn(e, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(e, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    for batch in (1, 16, 64, 256):
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        weights, ids = torch.rand(batch, e, device="cuda").topk(topk, dim=-1)
        touched = int(ids.unique().numel())
        s = _time(lambda: fused_moe(x, gate_up, down, weights, ids))
        nbytes = touched * (gate_up[0].numel() + down[0].numel()) * 2
        rows.append({"kernel": "fused_moe", "batch": batch, "experts_touched": touched, "us": s * 1e6,
                     "bytes_per_s": nbytes / s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_kernels_h200.json")
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / _time(lambda: dst.copy_(src))
    del src, dst
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = moe_rows() + attention_rows(args.context, num_sms)
    for r in rows:
        r["fraction_of_copy_bw"] = r["bytes_per_s"] / copy_bw
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    Path(args.out).write_text(json.dumps({"copy_bytes_per_s": copy_bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
