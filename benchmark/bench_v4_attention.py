"""DeepSeek-V4 sparse MQA decode attention (deepinfer_kernels.v4_attention) at V4-Flash's shape on the GPU: 64 heads
of 512 over an FP8 pool (e4m3 rows with fp32 row scales, as kv_cache_dtype='fp8_e4m3' keeps them), one query per
sequence, for the three kinds of layer (sliding window only; window + the indexer's top-k compressed entries, CSA;
window + every compressed entry, HCA), timed from CUDA-graph replays. Each row sets the launch (split kernels and
the combine, or the fused kernel; tiles) beside the bytes the call must read over the copy bandwidth measured in
the same run, and the largest difference from the split path's output.

    python benchmark/bench_v4_attention.py --out benchmark/results/gpu_v4_attention_h200.json
    STAGES=v4attn bash scripts/gpu_check.sh                     # the same, on the GPU machine
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench_kernels import _graph_time, ceilings
from deepinfer_kernels.v4_attention import KeySource, Tiles, sparse_mqa_attention

HEADS, DIM, WINDOW, TOPK = 64, 512, 128, 512
"""V4-Flash: 64 query heads, one 512-wide KV head, a 128-token sliding window, top-512 entries (CSA)."""
LAYERS = {"window": None, "csa": TOPK, "hca": 8192 // 128}
"""Entries a query reads besides its window: none, the top-k (ratio 4), all of them at 8K context (ratio 128)."""
VARIANTS = {
    "split": dict(fuse=False),
    "auto": dict(fuse=None),
    "auto_r128": dict(fuse=None, tiles=Tiles(maxnreg=128)),
    "auto_h32": dict(fuse=None, tiles=Tiles(max_rows=32)),
    "auto_n64": dict(fuse=None, tiles=Tiles(block_n=64)),
    "split_n64": dict(fuse=False, tiles=Tiles(block_n=64)),
    "split_w4": dict(fuse=False, tiles=Tiles(num_warps=4)),
    # 4 warps: two 16-row programs a multiprocessor (252 registers a thread) where 8 warps fit one (164)
    "h16_w4": dict(fuse=None, tiles=Tiles(max_rows=16, num_warps=4)),
}


def fp8_pool(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, DIM, generator=gen, device="cuda")
    scales = x.abs().amax(1).clamp(min=1e-6) / 448.0
    return (x / scales[:, None]).to(torch.float8_e4m3fn), scales


def sources(batch: int, layer: str, gen: torch.Generator) -> list[KeySource]:
    """Window rows (every key visible) and, for CSA / HCA, entry rows, each sequence's own, in FP8 pools."""
    win_vals, win_scales = fp8_pool(batch * WINDOW, gen)
    win_rows = torch.randperm(batch * WINDOW, generator=gen, device="cuda").view(batch, WINDOW)
    out = [KeySource(win_vals, win_rows, torch.ones(batch, 1, WINDOW, dtype=torch.bool, device="cuda"), win_scales)]
    if LAYERS[layer] is not None:
        n = LAYERS[layer]
        vals, scales = fp8_pool(batch * n * 4, gen)
        rows = torch.randperm(batch * n * 4, generator=gen, device="cuda")[: batch * n].view(batch, n)
        out.append(KeySource(vals, rows, None, scales))
    return out


def read_bytes(batch: int, srcs: list[KeySource]) -> int:
    """Bytes a call must move: its queries and outputs (bf16), every key row it reads (values, scale, index)."""
    keys = sum(s.rows.numel() * (DIM + 4 + 8) for s in srcs)
    return keys + 2 * batch * HEADS * DIM * 2


def bench(batches: list[int], variants: list[str], copy_bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in batches:
        for layer in LAYERS:
            srcs = sources(batch, layer, gen)
            q = torch.randn(batch, 1, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
            sink = torch.randn(HEADS, generator=gen, device="cuda")
            base = sparse_mqa_attention(q, srcs, sink, DIM ** -0.5, fuse=False).float()
            need = read_bytes(batch, srcs)
            for name in variants:
                kw = VARIANTS[name]
                row = {"batch": batch, "layer": layer, "variant": name, "bytes": need,
                       "floor_us": need / copy_bw * 1e6}
                try:
                    out = sparse_mqa_attention(q, srcs, sink, DIM ** -0.5, **kw)
                    row["max_abs_diff_vs_split"] = float((out.float() - base).abs().max())
                    seconds = _graph_time(lambda: sparse_mqa_attention(q, srcs, sink, DIM ** -0.5, **kw))
                    row.update(us=seconds * 1e6, fraction_of_copy_bw=need / seconds / copy_bw)
                except Exception as e:  # a variant that can't launch (registers, shared memory) is a row too
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_v4_attention_h200.json")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    copy_bw, _ = ceilings("cuda", 1 << 28)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": copy_bw,
              "heads": HEADS, "dim": DIM, "window": WINDOW, "entries": LAYERS,
              "rows": bench([int(b) for b in args.batches.split(",")], args.variants, copy_bw)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
