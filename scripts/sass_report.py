"""Compile one Triton kernel for sm90 on any machine (no GPU) and report what its build holds: registers, local
memory (spills), dynamic shared memory, and counts of the SASS instructions that tell how a tile moves (wgmma `HGMMA`,
`LDSM` / `STS` / `LDS` staging, `LDGSTS` asynchronous copies, conversions), plus the TTGIR's layout conversions.

The JIT assumes 16-byte alignment of every pointer and of each integer argument that is a multiple of 16 at the
call; a build without those hints loads byte by byte and stages tiles it would not, so pass the integer arguments
that are multiples of 16 in the real call with --aligned (pointers are aligned by default). Run it under the
Triton the GPU machine has (3.6 with its torch 2.11; this compile API differs in later releases): e.g.
`pip install --target /tmp/t36 --no-deps triton==3.6.0` and `PYTHONPATH=/tmp/t36`.

    python scripts/sass_report.py deepinfer_kernels.fp8_w16 _fp8_w16_kernel \
        --signature '{"X": "*bf16", "W": "*fp8e4nv", "WS": "*fp32", "B": "*fp32", "Y": "*bf16", "M": "i32",
                      "N": "i32", "K": "i32", "M_BUCKET": "i32", "stride_xm": "i32", "stride_wn": "i32",
                      "stride_wsn": "i32", "stride_ym": "i32"}' \
        --constexprs '{"HAS_BIAS": false, "GROUP_N": 32, "BLOCK_K": 32, "KSUB": 4, "BLOCK_N": 128,
                       "BLOCK_M": 128, "WIDE": false, "IEEE": false}' \
        --aligned N K stride_xm stride_wn stride_ym --warps 8 --stages 3
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

COUNTED = ("HGMMA", "HMMA", "LDSM", "STS", "LDS.", "LDGSTS", "LDG.", "STG", "F2FP", "PRMT", "FFMA", "BAR")


def compile_sm90(kernel, signature: dict, constexprs: dict, aligned: list[str], warps: int = 4, stages: int = 3):
    """`kernel` (a @triton.jit function) compiled for sm90: signature maps its non-constexpr arguments to Triton types,
    `aligned` names the arguments compiled as the JIT specializes 16-byte-aligned pointers and multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)  # attrs are keyed by the argument's place in the kernel's own list
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names and n in signature}
    full = dict(signature, **{k: "constexpr" for k in constexprs})
    return triton.compile(ASTSource(kernel, full, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def machine_code(compiled) -> tuple[str, str]:
    """(cuobjdump's resource usage, the SASS) of a compile_sm90 build, through the tools in Triton's wheel."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return usage, sass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    parser.add_argument("kernel")
    parser.add_argument("--signature", required=True, help="JSON: argument -> Triton type ('*bf16', 'i32', ...)")
    parser.add_argument("--constexprs", default="{}", help="JSON: constexpr argument -> value")
    parser.add_argument("--aligned", nargs="*", default=[], help="integer arguments that are multiples of 16")
    parser.add_argument("--unaligned-pointers", action="store_true")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dump", default=None, help="a folder for the .ttgir / .ptx / .sass")
    args = parser.parse_args()

    kernel = getattr(importlib.import_module(args.module), args.kernel)
    signature, constexprs = json.loads(args.signature), json.loads(args.constexprs)
    pointers = [] if args.unaligned_pointers else [n for n in signature if signature[n].startswith("*")]
    compiled = compile_sm90(kernel, signature, constexprs, pointers + args.aligned, args.warps, args.stages)
    usage, sass = machine_code(compiled)
    ttgir = compiled.asm["ttgir"]
    waits = sorted(set(re.findall(r"pendings = (\d+)", ttgir)), key=int)
    print(" ".join(line.strip() for line in usage.splitlines() if "REG" in line),
          f"dynamic shared memory {compiled.metadata.shared} B (an H100 / H200 block takes at most 232,448)")
    print("  ".join(f"{op.rstrip('.')} {len(re.findall(re.escape(op), sass))}" for op in COUNTED))
    print(f"ttgir: {ttgir.count('ttg.convert_layout')} convert_layout, {ttgir.count('ttg.local_alloc')} local_alloc, "
          f"{ttgir.count('ttg.async_copy_global_to_local')} async copies, wgmma waits with pendings {waits}")
    if args.dump:
        out = Path(args.dump)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.kernel}.ttgir").write_text(ttgir)
        (out / f"{args.kernel}.ptx").write_text(compiled.asm["ptx"])
        (out / f"{args.kernel}.sass").write_text(sass)


if __name__ == "__main__":
    main()
