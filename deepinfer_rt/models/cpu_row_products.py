"""How the flat CPU step (models/llama_step.py) multiplies a few bf16 rows by a dense weight: the products a lone
decode stream can take (ROW_PRODUCTS), the choice among them (DEEPINFER_CPU_BF16_GEMV, `choose_row_gemv`: as given,
or under 'auto' timed once per process on the model's gate_up), and the product a layer's linear then calls
(`bf16_linear_fn`). The decode-row kernels (deepinfer_kernels.cpu_row) are loaded through `row_kernels`."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger("deepinfer_rt")

ROW_PRODUCTS = ("linear", "mv", "packed", "kernel")
"""How a lone bf16 row (a single decode stream) is multiplied by a dense weight in the flat CPU step:

    linear   F.linear, the module path's op (oneDNN's matmul)
    mv       torch.mv, torch's bf16 GEMV: fp32 sums in another order, so bf16 values differ from F.linear's in the
             last bit
    packed   oneDNN's inner product over a copy of the weight reordered once for one row
             (torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise), for every row count once chosen: the
             same values as F.linear on the CPU measured, at the cost of that copy (the model's bf16 bytes again)
    kernel   our lone-row kernels (deepinfer_kernels.cpu_row, kernels/cpu/row_decode.cpp): each weight row streamed
             once through AVX512-BF16 dot products (fp32 sums in another order: bf16 values differ from F.linear's
             in the last bits), and a decode step's whole layer in one call where the step allows
             (CpuStep._row_forward); up to KERNEL_MAX_ROWS rows through the same product (a row's values the same
             whatever the row count), more through F.linear. Built on first use; where it cannot be built, `auto` leaves it out

Measured (bytes/s at one row, the embedded default's shapes, 2 threads): on an AMD EPYC with AVX512-BF16, F.linear
10.6-15.1 GB/s, torch.mv 8.6-14.0, packed 21-27, kernel 28-32; on an earlier AMX machine torch.mv was about twice
F.linear."""

KERNEL_MAX_ROWS = 64
"""Under 'kernel' (and for fp32 under DEEPINFER_CPU_FP32_ROW=kernel), a step of at most this many decode rows runs
each layer as one kernel call (CpuStep._row_forward), and bf16 products of at most this many rows go through the
kernels' product, which reads each weight row once for all of them; more through F.linear. Embedded default, bf16,
2-core EPYC, decode tok/s with the fused rows against F.linear's: batch 4 181 / 92, 8 228 / 121, 16 242 / 160,
32 236 / 194, 64 251 / 198."""

_ROW_GEMV: dict[str, str] = {}
"""'auto': what DEEPINFER_CPU_BF16_GEMV=auto chose (choose_row_gemv), once per process."""

ROW_GEMV_MARGIN = 1.15
"""`auto` leaves F.linear only for a product at least this much faster, so that a near tie (where timing noise
could pick either, and with it which bf16 bits a run produces) always goes to F.linear, the module path's op."""


def _time_row_product(fn, reps: int = 4, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _pack_for_row(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def _packed_product(packed: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, packed, None, "none", [], "")


def row_kernels():
    from deepinfer_kernels import cpu_row

    return cpu_row.load()


def choose_row_gemv(weight: torch.Tensor, setting: str) -> str:
    """One of ROW_PRODUCTS for a lone bf16 row: DEEPINFER_CPU_BF16_GEMV as given, or under 'auto' each timed on
    `weight` (the model's gate_up, its largest per-layer product), best of five rounds, and F.linear kept unless
    another is ROW_GEMV_MARGIN times faster (then the fastest). `auto` measures once per process."""
    if setting not in ("auto",) + ROW_PRODUCTS:
        raise ValueError(f"DEEPINFER_CPU_BF16_GEMV={setting!r}: not one of auto, {', '.join(ROW_PRODUCTS)}")
    if setting == "packed" and not _packed_available():
        raise ValueError("DEEPINFER_CPU_BF16_GEMV=packed: this torch build has no oneDNN (mkldnn) linear ops")
    if setting == "kernel" and row_kernels() is None:
        from deepinfer_kernels import cpu_row

        raise ValueError(f"DEEPINFER_CPU_BF16_GEMV=kernel: the lone-row CPU kernels cannot be built here "
                         f"({cpu_row.error()})")
    if setting != "auto":
        return setting
    if "auto" not in _ROW_GEMV:
        row = torch.ones(weight.shape[1], dtype=weight.dtype)
        times = {"linear": _time_row_product(lambda: F.linear(row, weight)),
                 "mv": _time_row_product(lambda: torch.mv(weight, row))}
        if _packed_available():
            packed, row2 = _pack_for_row(weight), row.view(1, -1)
            times["packed"] = _time_row_product(lambda: _packed_product(packed, row2))
        ops = row_kernels()
        if ops is not None:
            times["kernel"] = _time_row_product(lambda: ops.gemv(row, weight, True))
        fastest = min(times, key=times.get)
        _ROW_GEMV["auto"] = fastest if times["linear"] >= ROW_GEMV_MARGIN * times[fastest] else "linear"
        logger.info("lone bf16 rows take %s (gate_up %s, us per 4 products: %s)", _ROW_GEMV["auto"],
                    tuple(weight.shape), ", ".join(f"{k} {v * 1e6:.0f}" for k, v in times.items()))
    return _ROW_GEMV["auto"]


def bf16_linear_fn(weight: torch.Tensor, row: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (T, K) or a lone row (K,) -> x @ weight.T in bf16: one row through the `row` product (ROW_PRODUCTS), more
    rows through F.linear, or under `packed` through the packed copy too (on the AMD EPYC measured: 4.7 against 8.4
    ms at 4 rows of 30 gate_up weights, 35 against 40 ms at 1,024 rows, values equal to F.linear's). A 1-D row
    (the step's lone-stream form) goes as it is: no select / unsqueeze."""
    if row == "packed":
        packed = _pack_for_row(weight)

        def product(x: torch.Tensor) -> torch.Tensor:  # any row count: 1.05-1.8x F.linear up to 1K rows here
            return _packed_product(packed, x.view(1, -1)).view(-1) if x.dim() == 1 else _packed_product(packed, x)
        return product
    if row == "kernel":
        gemv = row_kernels().gemv

        def product(x: torch.Tensor) -> torch.Tensor:  # a few rows: each weight row read once for all of them
            if x.dim() == 1 or x.shape[0] <= KERNEL_MAX_ROWS:
                return gemv(x.contiguous(), weight, True)
            return F.linear(x, weight)
        return product
    if row == "mv":
        def product(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 1:
                return torch.mv(weight, x)
            return torch.mv(weight, x[0]).unsqueeze(0) if x.shape[0] == 1 else F.linear(x, weight)
        return product
    return lambda x: F.linear(x, weight)
