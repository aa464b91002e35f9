"""Kernels not yet run on a GPU compile for Hopper (sm_90) here, through Triton's own ptxas
(scripts/sm90_compile_check.py): no spill to local memory, and the weight stream in 16-byte loads (a kernel the
compiler cannot prove aligned loads byte by byte). The interpreter checks their values; this checks what only a
compile shows."""
from __future__ import annotations

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
    pytest.skip("Triton without its NVIDIA backend tools", allow_module_level=True)

from sm90_compile_check import _cases, compile_case  # noqa: E402

CHECKED = ("dequant_32x32", "gemv_kernel_quant_32x32", "moe_fp8_tiled_down_fp8_m16_n64")


@pytest.mark.parametrize("name", CHECKED)
def test_compiles_for_sm90_without_spills_and_with_wide_loads(name):
    (case,) = [c for c in _cases() if c[0] == name]
    report = compile_case(*case[1:])
    assert report["reg"] > 0 and report["local"] == 0, report
    assert any(op.endswith(".128") and op.startswith(("LDG", "LDGSTS")) for op in report["ops"]), report
