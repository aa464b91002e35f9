"""Compile the Triton kernels that no GPU has run yet for Hopper (sm_90), without a GPU, and report what the machine
code holds (sass_report.py's build, over a list of cases): registers, dynamic shared memory, spills (local memory),
the widths of the global loads and stores, and the tensor-core ops. A compile-only failure (a construct the
interpreter accepts and the compiler does not), a spill or byte-wide loads show here instead of costing device time.

    python scripts/sm90_compile_check.py                       # every case below; JSON to stdout
    python scripts/sm90_compile_check.py dequant moe_fp8_tiled  # cases whose name starts with these
    PYTHONPATH=/path/to/triton-3.6 python scripts/sm90_compile_check.py   # the GPU machine's Triton (torch 2.11)

Integer arguments are compiled as the runtime specializes them for the shapes that matter here (multiples of 16, and
16-byte aligned pointers): without that hint the same kernel loads byte by byte. Needs Triton's NVIDIA backend
(ptxas and cuobjdump ship in its wheel).
"""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from sass_report import compile_sm90, machine_code  # noqa: E402

POINTERS = {"fp8": "*fp8e4nv", "f32": "*fp32", "bf16": "*bf16", "i32": "*i32"}
NOT_ALIGNED = {"num_pairs", "pairs_bucket", "top_k", "up_row0", "num_tokens", "steps_per_split", "m", "splits",
               "eps", "iters"}
"""Integer arguments that are counts, not sizes or strides: compiled without the multiple-of-16 hint."""
SASS_OPS = r"\b(LDG\.E[A-Z0-9.]*|STG\.E[A-Z0-9.]*|LDGSTS\.E[A-Z0-9.]*|QGMMA|HGMMA|HMMA|IMMA|F2FP[A-Z0-9.]*)"


def _cases():
    """name -> (kernel, {argument: pointer dtype key}, constexprs, options), one row a compiled variant."""
    from deepinfer_kernels import fp8_dequant, fp8_gemm, fp8_gemv, fp8_quant, fp8_w16, fused_moe_fp8, v4_hyper

    tile = fp8_dequant.DEQUANT_TILE
    for gn, gk in ((32, 32), (128, 128)):
        yield (f"dequant_{gn}x{gk}", fp8_dequant._dequant_kernel, dict(W="fp8", WS="f32", Out="bf16"),
               dict(GROUP_N=gn, GROUP_K=gk, BLOCK_N=tile["BLOCK_N"], BLOCK_K=max(tile["BLOCK_K"], gk)),
               dict(num_warps=tile["num_warps"]))
    moe = dict(XQ="fp8", AQ="fp8", XS="f32", AS="f32", W="fp8", WS="f32", H="bf16", Y="bf16", TopkWeights="f32",
               SortedPairs="i32", BlockExpert="i32", NumPadded="i32")
    for layout, tiled in (("rows", False), ("tiled", True)):
        for kernel in (fused_moe_fp8._gate_up_fp8, fused_moe_fp8._down_fp8):
            for bm, bn, warps, stages in ((16, 64, 4, 3), (64, 128, 4, 4)):
                yield (f"moe_fp8_{layout}{kernel.__name__}_m{bm}_n{bn}", kernel, moe,
                       dict(GROUP_N=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, PER_PAIR=False, EVEN_K=True,
                            IS_INTERPRETED=False, PDL=False, TILED=tiled), dict(num_warps=warps, num_stages=stages))
    gemv = dict(XQ="bf16", XS="f32", W="fp8", WS="f32", P="f32", Y="bf16")
    for quant in (False, True):
        for gn, bk in ((32, 32), (128, 128)):
            yield (f"gemv_{'kernel' if quant else 'launch'}_quant_{gn}x{bk}", fp8_gemv._fp8_gemv_kernel,
                   dict(gemv, XQ="bf16" if quant else "fp8"),
                   dict(BLOCK_N=32, KC=max(bk, 128), BK=bk, GROUP_N=gn, GROUP_ROWS=0, DIRECT=True, PDL=False,
                        QUANT=quant, IS_INTERPRETED=False), dict(num_warps=4))
    for ieee, x in ((False, "bf16"), (True, "f32")):  # IEEE: fp32 activations, fp32 products
        yield (f"w16_{x}", fp8_w16._fp8_w16_kernel, dict(X=x, W="fp8", WS="f32", B="f32", Y=x),
               dict(HAS_BIAS=False, GROUP_N=32, BLOCK_K=32, KSUB=4, BLOCK_N=128, BLOCK_M=64, WIDE=True, IEEE=ieee),
               dict(num_warps=4, num_stages=3))
    yield ("quantize_token_groups", fp8_quant._quantize_token_groups_kernel, dict(X="bf16", Q="fp8", S="f32"),
           dict(BLOCK_M=16, GROUP=128, IS_INTERPRETED=False, PDL=False), dict(num_warps=4))
    for bm, bn, warps, stages in ((16, 32, 4, 5), (64, 128, 4, 3)):  # the fused kernel's split and whole tiles
        yield (f"fp8_block_gemm_m{bm}", fp8_gemm._fp8_block_gemm_kernel,
               dict(X="bf16", W="fp8", WS="f32", B="f32", Y="bf16", P="f32", Count="i32"),
               dict(HAS_BIAS=False, GROUP_N=128, GROUP_ROWS=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=1,
                    LAST_SUMS=False, IS_INTERPRETED=False, PDL=False), dict(num_warps=warps, num_stages=stages))
    yield ("hc_logits_partial", v4_hyper._hc_logits_partial_kernel, dict(X="bf16", W="f32", Part="f32", SumSq="f32"),
           dict(BLOCK_T=16, BLOCK_M=32, BLOCK_K=64, PDL=False), dict(num_warps=4))
    yield ("hc_logits_finish", v4_hyper._hc_logits_finish_kernel, dict(Part="f32", SumSq="f32", Out="f32"),
           dict(BLOCK_T=16, BLOCK_M=32, PDL=False), dict(num_warps=4))


def compile_case(kernel, pointers: dict, constexprs: dict, options: dict) -> dict:
    """Compile one variant for sm90 (sass_report.compile_sm90); its resource use and SASS op counts."""
    signature = {name: POINTERS[pointers[name]] if name in pointers else ("fp32" if name == "eps" else "i32")
                 for name in kernel.arg_names if name not in constexprs}
    aligned = [name for name in signature if name not in NOT_ALIGNED]
    compiled = compile_sm90(kernel, signature, constexprs, aligned, options.get("num_warps", 4),
                            options.get("num_stages", 3))
    usage, sass = machine_code(compiled)
    resources = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return {**resources, "dynamic_shared": compiled.metadata.shared,
            "ops": dict(sorted(collections.Counter(re.findall(SASS_OPS, sass)).items()))}


def main(prefixes: list[str]) -> int:
    report, failed = {"triton": triton.__version__, "target": "sm_90", "cases": {}}, 0
    for name, kernel, pointers, constexprs, options in _cases():
        if prefixes and not name.startswith(tuple(prefixes)):
            continue
        try:
            report["cases"][name] = compile_case(kernel, pointers, constexprs, options)
        except Exception as e:  # noqa: BLE001 -- a failed compile is this tool's finding
            failed += 1
            report["cases"][name] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
    print(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
