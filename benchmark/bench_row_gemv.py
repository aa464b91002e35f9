"""The fused row products (kernels/row_gemv.py) against the module path's kernels, at a small model's decode shapes.

For each of a Llama layer's products (SmolLM2-135M by default: qkv with the residual add and RMSNorm before it, the
same with the rotary and the K/V store after it (qkv_rope_store), o, gate_up with the add + norm before and
SiLU-and-mul after, down) and each row count: the module path's chain (add + RMSNorm kernel, cuBLAS, the rope + store
kernel, SiLU-and-mul kernel), row_gemv with the engine's tile rule, and row_gemv with every
tile in a small sweep. Times are CUDA-graph replays (median), beside the floor: the weight's bytes over the copy
bandwidth measured in the same run.

    python benchmark/bench_row_gemv.py --out benchmark/results/gpu_row_gemv_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from deepinfer_kernels.elementwise import gqa_rope_store, rms_norm, rope_cache, silu_and_mul
from deepinfer_kernels.row_gemv import MAX_ROWS, qkv_rope_store, row_gemv, tiles_for

SHAPES = {"smollm2-135m": (576, 960, 1536), "llama-1b": (2048, 3072, 8192)}
"""(hidden, qkv outputs, intermediate)."""


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graph_us(lambda: dst.copy_(src)) / 1e6)


def products(hidden: int, qkv: int, inter: int, rows: int, dtype=torch.bfloat16):
    """(name, module-path fn, fused fn(config), weight) of the products, on random tensors."""
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=dtype) * scale

    x, r, o_in, h_in = rand(rows, hidden), rand(rows, hidden), rand(rows, hidden), rand(rows, inter)
    nw = 1 + rand(hidden, scale=0.1)
    w_qkv, w_o = rand(qkv, hidden, scale=hidden**-0.5), rand(hidden, hidden, scale=hidden**-0.5)
    w_gu, w_down = rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5)
    d, hkv = 64, (qkv // 64 - hidden // 64) // 2  # the shapes' heads: 64 wide, the rest of qkv is K and V
    hq = qkv // d - 2 * hkv
    cos, sin = rope_cache(torch.rand(d // 2, device="cuda"), 1.0, 4096, torch.device("cuda"))
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    slots = torch.arange(rows, device="cuda")
    k_buf, v_buf = (torch.empty(64, hkv, d, device="cuda", dtype=dtype) for _ in range(2))

    def module_qkv_rope_store():
        q, k, v = F.linear(rms_norm(x, nw, 1e-5, r)[0], w_qkv).view(rows, -1, d).split([hq, hkv, hkv], dim=1)
        gqa_rope_store(q, k, v, positions, cos, sin, False, k_buf, v_buf, slots)

    return [
        ("qkv (add + norm)", lambda: F.linear(rms_norm(x, nw, 1e-5, r)[0], w_qkv),
         lambda c: row_gemv(x, w_qkv, residual=r, norm_weight=nw, eps=1e-5, config=c), w_qkv),
        ("qkv (add + norm, rope, store)", module_qkv_rope_store,
         lambda c: qkv_rope_store(x, w_qkv, hq, hkv, positions, cos, sin, False, k_buf, v_buf, slots, residual=r,
                                  norm_weight=nw, eps=1e-5, config=c), w_qkv),
        ("o", lambda: F.linear(o_in, w_o), lambda c: row_gemv(o_in, w_o, config=c), w_o),
        ("gate_up (add + norm, silu)", lambda: silu_and_mul(F.linear(rms_norm(x, nw, 1e-5, r)[0], w_gu)),
         lambda c: row_gemv(x, w_gu, residual=r, norm_weight=nw, eps=1e-5, silu_mul=True, config=c), w_gu),
        ("down", lambda: F.linear(h_in, w_down), lambda c: row_gemv(h_in, w_down, config=c), w_down),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_row_gemv_h100.json")
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    if max(args.rows) > MAX_ROWS:
        sys.exit(f"row_gemv takes at most {MAX_ROWS} rows")
    bw = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "copy_bytes_per_s": bw, "rows": []}
    sweep = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn, bk, w in
             itertools.product((2, 4, 8, 16), (256, 512, 1024), (2, 4))]
    for shape in args.shapes:
        for rows in args.rows:
            totals = {"module": 0.0, "rule": 0.0, "best": 0.0}  # the layer's products: qkv with rope + store
            for name, module, fused, w in products(*SHAPES[shape], rows):
                floor = w.numel() * w.element_size() / bw * 1e6
                row = {"shape": shape, "rows": rows, "product": name, "floor_us": floor, "module_us": graph_us(module),
                       "rule": tiles_for(rows, w.shape[0] // (2 if "silu" in name else 1), w.shape[1]),
                       "rule_us": graph_us(lambda: fused(None)), "sweep": []}
                for cfg in sweep:
                    if cfg["BLOCK_K"] * triton.next_power_of_2(rows) * cfg["BLOCK_N"] > 16384 * cfg["num_warps"] // 4:
                        continue  # the product tile would spill
                    try:
                        row["sweep"].append(dict(cfg, us=graph_us(lambda: fused(cfg))))
                    except Exception as exc:  # a tile the compiler refuses
                        row["sweep"].append(dict(cfg, error=str(exc)[:200]))
                timed = [c for c in row["sweep"] if "us" in c]
                row["best"] = min(timed, key=lambda c: c["us"])
                result["rows"].append(row)
                for key, us in (("module", row["module_us"]), ("rule", row["rule_us"]), ("best", row["best"]["us"])):
                    totals[key] += us if name != "qkv (add + norm)" else 0.0
                print(f"{shape} rows={rows} {name:28s} module {row['module_us']:6.2f} us  fused (rule) "
                      f"{row['rule_us']:6.2f}  best {row['best']['us']:6.2f} {row['best']}  floor {floor:5.2f}",
                      flush=True)
            result.setdefault("layer_totals", []).append(dict(shape=shape, rows=rows, **totals))
            print(f"{shape} rows={rows} a layer's products: module {totals['module']:.2f} us, fused {totals['rule']:.2f}"
                  f" (best tiles {totals['best']:.2f})", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
