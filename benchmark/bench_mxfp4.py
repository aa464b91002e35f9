"""The fused MXFP4 MoE rows of bench_kernels.py (--only mxfp4): V4-Flash's routed experts in 4-bit beside the bf16
fused MoE on the same weights, per batch size and tile configuration, over the read-only bandwidth of the run."""
from __future__ import annotations

import functools
import statistics
from pathlib import Path

import torch
import triton

from deepinfer_kernels.fused_moe import fused_moe

from bench_kernels import _graph_time, _time, print_row


def read_bandwidth(numel: int = 1 << 30) -> float:
    """Bytes/s of a read-only pass (a sum over 2 GB of bf16): a weight-streaming kernel's ceiling, which a copy's
    mixed reads and writes (copy_bw) sit below."""
    src = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    return src.numel() * 2 / _time(lambda: src.sum(dtype=torch.float32))


MXFP4_ROTATIONS = 4
"""Routings cycled within one timed call, so that no expert's weights stay in L2 from the previous launch."""
FRAG_CANDIDATES = {"frag_n64_w4": dict(BLOCK_N=64, num_warps=4, num_stages=3),
                   "frag_n64_w4_s4": dict(BLOCK_N=64, num_warps=4, num_stages=4),
                   "frag_n128_w4": dict(BLOCK_N=128, num_warps=4, num_stages=3),
                   "frag_n128_w8": dict(BLOCK_N=128, num_warps=8, num_stages=3),
                   # 16-pair row blocks where fused_moe's rule takes 32 (256 tokens of top-8): 123 against 140
                   # registers in gate_up's SASS (sm90), so four programs a multiprocessor instead of three
                   "frag_n64_m16": dict(BLOCK_N=64, num_warps=4, num_stages=3, BLOCK_M=16)}
"""deepinfer_kernels.fused_moe_mxfp4_frag's tiles, over the same experts repacked into the fragment order."""


def _frag_module(path: str):
    """A fused_moe_mxfp4_frag module from a file (an earlier or trial version, over the same repacked bytes)."""
    import importlib.util

    name = "frag_file_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mxfp4_moe_rows(copy_bw: float, batches: tuple[int, ...] = (1, 16, 64, 256, 2048),
                   names: tuple[str, ...] | None = None, frag_files: tuple[str, ...] = ()) -> list[dict]:
    """V4-Flash's routed experts: fused_moe_mxfp4 (4-bit weights, clamped SwiGLU) under each
    of MXFP4_CANDIDATES (those whose name starts with one of `names`, when given) and the default table (_tiles),
    beside fused_moe on the same weights in bf16, per batch. frag_files: fused_moe_mxfp4_frag modules from files
    (earlier or trial versions) timed at their own default tiles as `file_<stem>`, with their largest difference from
    this checkout's fragment-order kernel on the first routing.
    Each timed call runs MXFP4_ROTATIONS launches over different random routings (the same for both kernels); the
    bytes are those of the experts each launch touches, at 0.5 + 1/32 bytes per weight (e2m1 + e8m0) for MXFP4 and
    2 for bf16, plus the activations in and out, over the copy and the read-only bandwidth of this run."""
    from deepinfer_kernels import fused_moe_mxfp4 as mx
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4, quantize_mxfp4

    read_bw = read_bandwidth()
    e, hidden, inter, topk = 256, 4096, 2048, 8
    packed, dense = [], []
    for shape in ((2 * inter, hidden), (hidden, inter)):
        parts = [quantize_mxfp4(torch.randn(16, *shape, device="cuda") * 0.02) for _ in range(e // 16)]
        packed += [torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])]
        dense.append(torch.cat([dequantize_mxfp4(q, s, torch.bfloat16) for q, s in parts]))
    q_gu, s_gu, qd, sd = packed
    from deepinfer_kernels import fused_moe_mxfp4_frag as frag

    # the fragment order and 64-row tiles (same bytes), the scales in the same tiles
    f_gu, f_d, fs_gu, fs_d = (frag.repack_fragment(q_gu), frag.repack_fragment(qd), frag.repack_scales(s_gu),
                              frag.repack_scales(sd))
    frag_fast = frag.fast_scales(s_gu, sd)
    per_expert = 3 * hidden * inter
    rows = []
    for batch in batches:
        inputs = []
        for _ in range(MXFP4_ROTATIONS):
            weights, ids = torch.rand(batch, e, device="cuda").topk(topk, dim=-1)
            inputs.append((torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda"), weights, ids))
        touched = statistics.mean(int(ids.unique().numel()) for _, _, ids in inputs)
        act_bytes = 2 * batch * hidden * 2
        mx_bytes, bf_bytes = touched * per_expert * (0.5 + 1 / 32) + act_bytes, touched * per_expert * 2 + act_bytes

        def rotated(run):
            def fn():
                for x, weights, ids in inputs:
                    run(x, weights, ids)
            return _graph_time(fn) / MXFP4_ROTATIONS

        bf = rotated(lambda x, w, i: fused_moe(x, *dense, w, i))
        row = {"kernel": "fused_moe_mxfp4", "batch": batch, "experts_touched": touched, "bf16_us": bf * 1e6,
               "bf16_fraction_of_copy_bw": bf_bytes / bf / copy_bw,
               "bf16_fraction_of_read_bw": bf_bytes / bf / read_bw, "read_bytes_per_s": read_bw,
               "default_tiles": mx._tiles(batch * topk, torch.bfloat16)}
        configs = {**{name: config for name, config in {**mx.MXFP4_CANDIDATES, **FRAG_CANDIDATES}.items()
                      if names is None or name.startswith(tuple(names))}, "default": None}
        for name, config in configs.items():
            if name.startswith("frag"):
                run = functools.partial(frag.fused_moe_mxfp4_frag, fast=frag_fast, config=config)
                args = (f_gu, fs_gu, f_d, fs_d)
            else:
                run, args = functools.partial(mx.fused_moe_mxfp4, config=config), (q_gu, s_gu, qd, sd)
            try:
                t = rotated(lambda x, w, i: run(x, *args, w, i, 10.0))
            except triton.runtime.errors.OutOfResources:
                continue  # the tile does not fit shared memory at this depth
            except Exception as err:  # a form this Triton build cannot compile: recorded, the others still run
                row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                continue
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_fraction_of_read_bw"] = mx_bytes / t / read_bw
            row[f"{name}_speedup_over_bf16"] = bf / t
        for path in frag_files:
            name, module = "file_" + Path(path).stem, _frag_module(path)
            x, weights, ids = inputs[0]
            ref = frag.fused_moe_mxfp4_frag(x, f_gu, fs_gu, f_d, fs_d, weights, ids, 10.0, fast=frag_fast)
            tiles = getattr(module, "repack_scales", lambda s: s)  # versions before the tiled layout: rows
            mine = (module.repack_fragment(q_gu), tiles(s_gu), module.repack_fragment(qd), tiles(sd))
            out = module.fused_moe_mxfp4_frag(x, *mine, weights, ids, 10.0, fast=frag_fast)
            row[f"{name}_max_diff"] = float((out.float() - ref.float()).abs().max())
            t = rotated(lambda x, w, i: module.fused_moe_mxfp4_frag(x, *mine, w, i, 10.0, fast=frag_fast))
            del mine
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_fraction_of_read_bw"] = mx_bytes / t / read_bw
        best = min((k for k in row if k.endswith("_us") and k != "bf16_us"), key=row.get)
        row["fastest"] = best[:-3]
        rows.append(row)
        print_row(row)
    return rows
