"""The environment of the subprocesses that run Triton kernels through its CPU interpreter."""

INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "OPENBLAS_CORETYPE": "Sandybridge"}
"""The interpreter's tl.dot is numpy's matmul. OpenBLAS's Haswell sgemm kernel (what it picks on CPUs without
AVX-512, AMD EPYC among them) rounds an output column by its place in the register tile, so the same key in two
tiles scored apart by an ulp and the bitwise checks (batch invariance, ties) failed there; the Sandybridge kernel
(any x86-64 with AVX) rounds every column alike. The GPU suite checks the same properties compiled."""
