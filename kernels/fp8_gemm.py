"""Block-scaled W8A8 FP8 GEMMs (DeepSeek-V3/R1 weights on Hopper): y = x @ dequant(w).T.

w is float8 e4m3 (N, K) with a float32 scale per GROUP_N rows x BLOCK_K columns (`weight_scale_inv`: 128 x 128
blocks in the V3 release; GROUP_N = 1 when a merged layer's shards do not start on a block boundary and the
scales were expanded per row). The activations are quantized inside the kernel, per token and per BLOCK_K
channels (amax / 448, the releases' dynamic scheme), so x comes in its own 16/32-bit dtype and no quantized copy
of it is written. Each K step is one fp8 tensor-core dot of a BLOCK_K slice, exact products summed in fp32,
then scaled by the token's activation scale and the weight block's scale and added to the fp32 accumulator:

    acc[m, n] += dot(q(x)[m, k0:k0+BK], w[n, k0:k0+BK]) * s_x[m, k0 / BK] * s_w[n / GROUP_N, k0 / BK]

At up to SPLIT_K_MAX_ROWS rows K is split over programs (split_k_for) and the fp32 partials summed in split order
(deterministic) by a second kernel, or by each output tile's last split to finish (split_sum 'last_program': one
launch, the same bits); above, each output is one program's sum in K order.

Three paths (`fp8_gemm(..., path=)`, chosen by DEEPINFER_FP8_GEMM where the layer's method is built):

    triton     fp8_block_gemm: the fused kernel above, small tiles by row count (the first default)
    tiled      fp8_tiled_gemm: activations quantized once (deepinfer_kernels.fp8_quant, the same values), then
               a GEMM over them with autotuned tiles up to 128 x 256, the same per-K-block fp32 scaling
    scaled_mm  fp8_scaled_mm (deepinfer_kernels.fp8_scaled_mm): the same quantized activations into scaled_mm with the
               BlockWise1x128 / BlockWise128x128 recipes (cuBLASLt, SM90, torch >= 2.10); GEMMs it does not
               take (N or K not a multiple of 128, per-row scales, a non-bf16 output) run the tiled path
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait
from deepinfer_kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv
from deepinfer_kernels.fp8_quant import interpreted_e4m3, quantize_fp8_token_groups, quantize_groups
from deepinfer_kernels.fp8_scaled_mm import (SCALED_MM_ROW_MULTIPLE, fp8_scaled_mm, scaled_mm_api_missing,  # noqa: F401
                                             scaled_mm_shape_unsupported, scaled_mm_unsupported)
from deepinfer_kernels.fp8_split import (TILED_K_STEP, _group_rows, _split_k_sum_kernel, group_tile_n,
                                         m_bucket)



@triton.jit
def _fp8_block_gemm_kernel(X, W, WS, B, Y, P, Count, M, N, K, kb_per_split, stride_xm, stride_xg, stride_wn,
                           stride_wsn, stride_ym, HAS_BIAS: tl.constexpr, GROUP_N: tl.constexpr,
                           GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           LAST_SUMS: tl.constexpr, IS_INTERPRETED: tl.constexpr, PDL: tl.constexpr):
    """Program (m tile, n tile, split): K blocks [split * kb_per_split, (split + 1) * kb_per_split). One split
    writes Y; several write fp32 partial sums to P (SPLIT_K, M, N), which _split_k_sum_kernel adds in split order,
    or with LAST_SUMS the tile's last split to finish (a counter per tile at Count, reset by it) adds them in the
    same order itself. GROUP_ROWS > 0: a grouped GEMM (fp8_block_gemm's `groups`), output rows [g * GROUP_ROWS,
    (g + 1) * GROUP_ROWS) reading x's columns from g * stride_xg (BLOCK_N divides GROUP_ROWS)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    kb0 = pid_s * kb_per_split
    kb1 = tl.minimum(tl.cdiv(K, BLOCK_K), kb0 + kb_per_split)
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + kb0 * BLOCK_K + offs_k[None, :]
    if GROUP_ROWS > 0:
        x_ptrs += (pid_n * BLOCK_N // GROUP_ROWS) * stride_xg
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + kb0 * BLOCK_K + offs_k[None, :]
    ws_ptrs = WS + (offs_n // GROUP_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb0, kb1):
        kmask = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        v, x_scale = quantize_groups(x)  # x_scale (BLOCK_M,)
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        w_scale = tl.load(ws_ptrs + kb, mask=nmask, other=0.0)  # (BLOCK_N,)
        if IS_INTERPRETED:
            # Triton's interpreter drops the carry when an fp32 -> e4m3 cast rounds up to the next power of two
            # (127.96 -> 64): round to e4m3's grid in fp32 instead, as the quantizer does, and dot exact fp32 copies.
            part = tl.dot(interpreted_e4m3(v), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(v.to(tl.float8e4nv), tl.trans(w))
        acc += part * x_scale[:, None] * w_scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
    else:
        mask = mmask[:, None] & nmask[None, :]
        tl.store(P + (pid_s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :], acc, mask=mask)
        if LAST_SUMS:
            tl.debug_barrier()  # every thread's partial is stored before the count (release, GPU scope)
            tile = pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(Count + tile, 1, sem="acq_rel") == SPLIT_K - 1:
                total = tl.load(P + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask, other=0.0,
                                cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):  # the order of _split_k_sum_kernel: the same bits
                    total += tl.load(P + (s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :], mask=mask,
                                     other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], total.to(Y.dtype.element_ty),
                         mask=mask)
                tl.atomic_xchg(Count + tile, 0)  # for the next launch (a replayed graph's too)


SPLIT_K_MAX_ROWS = 16
"""Row counts up to this split K on the GPU (split_k_for): at decode sizes a GEMM has too few output tiles to keep
the multiprocessors busy, and each one's K loop is a chain of dependent loads."""


def split_k_for(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, num_sms: int,
                max_rows: int = SPLIT_K_MAX_ROWS) -> int:
    """Splits of K for the fused kernel: about four programs per multiprocessor, a power of two, each split at
    least two K blocks; 1 above max_rows rows."""
    if m > max_rows:
        return 1
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    want = max(1, 4 * num_sms // tiles)
    split = 1 << (want.bit_length() - 1)
    return max(1, min(split, triton.cdiv(k, block_k) // 2))


def _config(m: int) -> dict:
    """Tiles by row count, the fastest of a sweep on an H200 (BLOCK_M 16-128, BLOCK_N 16-128, 4/8 warps, 3-5
    stages) at V2-Lite's fused_qkv_a (3648 x 2048), dense down (2048 x 10944) and gate_up (21888 x 2048): narrow N
    tiles for decode-sized x (more programs streaming the weight), 64 x 128 from a few hundred rows. Still 1.2-2.5x
    the time of cuBLAS bf16 on the dequantized weight (13 / 20 / 118 us against 11 / 12 / 49 us at M = 1 / 64 /
    2048 on fused_qkv_a): the activations are quantized again by every N tile."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=5)
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)


SPLIT_SUMS = ("kernel", "last_program")
"""How the split fused kernel's fp32 partials are added (DEEPINFER_FP8_SPLIT_SUM): by a second kernel, or by each
output tile's last split to finish (one launch; the same sum, bit for bit)."""
_TILE_COUNTERS = 1 << 16
"""Output tiles the last-program sum takes (one int32 counter each, per device, zero between launches); a GEMM
of more tiles adds its partials in the second kernel. The counters are shared by every launch on the device, so
'last_program' needs its GEMMs in one stream order (the engine's: one compute stream, graphs captured and replayed
in it): two such GEMMs running at once on two streams would mix their counts."""
_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """The device's counters: made once and kept, so a captured graph's pointer stays valid."""
    if device not in _counters:
        _counters[device] = torch.zeros(_TILE_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int,
                   block_k: int, bias: torch.Tensor | None = None, config: dict | None = None,
                   split_k: int | None = None, split_sum: str = "kernel", pdl: bool = False,
                   groups: int = 1, split_rows: int = SPLIT_K_MAX_ROWS) -> torch.Tensor:
    """x (..., K) 16/32-bit, weight (N, K) float8_e4m3fn, weight_scale_inv (ceil(N/group_n), ceil(K/block_k))
    float32 -> (..., N) in x's dtype. block_k is the weights' column block and the activations' group (a power
    of two >= 16). config: fixed BLOCK_M / BLOCK_N / num_warps / num_stages (the interpreter test). split_k: K
    split over that many programs per output tile, their fp32 partial sums added in order by a second kernel or,
    with split_sum 'last_program', by the tile's last split (None: split_k_for on the GPU, 1 elsewhere). pdl: both
    launches programmatic dependent ones (dispatch.pdl_launch). split_rows: the most rows split_k_for splits K
    at. groups > 1: a block-diagonal (grouped) GEMM, x
    (..., groups * K) and weight (groups * R, K): output rows [g * R, (g + 1) * R) are x's g-th K columns times
    those weight rows (V4's grouped output projection)."""
    rows = _group_rows(x, weight, groups)
    k = weight.shape[1]
    x2 = x.reshape(-1, groups * k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
    assert weight_scale_inv.shape == (triton.cdiv(n, group_n), triton.cdiv(k, block_k))
    y = x.new_empty(m, n)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    config = dict(config or _config(m))
    if rows:
        config["BLOCK_N"] = group_tile_n(config["BLOCK_N"], rows)
    num_kb = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = 1 if x.device.type != "cuda" else split_k_for(
            m, n, k, config["BLOCK_M"], config["BLOCK_N"], block_k,
            torch.cuda.get_device_properties(x.device).multi_processor_count, split_rows)
    kb_per_split = triton.cdiv(num_kb, max(1, split_k))
    split_k = triton.cdiv(num_kb, kb_per_split)  # no empty split
    if split_sum not in SPLIT_SUMS:
        raise ValueError(f"split_sum must be one of {SPLIT_SUMS}, got {split_sum!r}")
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), split_k)
    last_sums = split_k > 1 and split_sum == "last_program" and grid[0] * grid[1] <= _TILE_COUNTERS
    bias_arg = bias if bias is not None else weight_scale_inv
    _fp8_block_gemm_kernel[grid](
        x2, weight, weight_scale_inv, bias_arg, y, part, _tile_counters(x.device) if last_sums else part, m, n, k,
        kb_per_split, x2.stride(0), k, weight.stride(0), weight_scale_inv.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GROUP_N=group_n, GROUP_ROWS=rows, BLOCK_K=block_k, SPLIT_K=split_k, LAST_SUMS=last_sums,
        IS_INTERPRETED=x.device.type == "cpu", **config, **pdl_launch(pdl))
    if split_k > 1 and not last_sums:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_sum_kernel[(m, triton.cdiv(n, block))](part, bias_arg, y, m, n, y.stride(0),
                                                         HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=block,
                                                         **pdl_launch(pdl))
    return y.view(*x.shape[:-1], n)


# ---- over pre-quantized activations (deepinfer_kernels.fp8_quant): the tiled Triton GEMM, torch's scaled_mm ----

@triton.jit
def _fp8_tiled_gemm_kernel(XQ, XS, W, WS, B, Y, M, N, K, M_BUCKET, stride_xm, stride_xg, stride_xsm, stride_xsk,
                           stride_xsg, stride_wn, stride_wsn, stride_ym, HAS_BIAS: tl.constexpr,
                           GROUP_N: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KSUB: tl.constexpr,
                           GROUP_M: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """acc[m, n] += dot(xq[m, k0:k0+BK], w[n, k0:k0+BK]) * xs[m, k0 / BK] * ws[n / GROUP_N, k0 / BK], the fused
    kernel's sum with the activations read quantized. M_BUCKET only keys the autotuner. Programs walk GROUP_M row
    tiles per column tile, so a wave of programs shares weight tiles in L2. GROUP_ROWS > 0: grouped, as the fused
    kernel's (x's values and scales of group g from g * stride_xg and g * stride_xsg). KSUB scale blocks a step:
    narrow blocks (V4.1's 32) read KSUB * BLOCK_K bytes of each weight row together, one dot and one rescale a
    block."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_ptrs = XQ + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    xs_ptrs = XS + offs_m * stride_xsm
    if GROUP_ROWS > 0:
        group = pid_n * BLOCK_N // GROUP_ROWS
        x_ptrs += group * stride_xg
        xs_ptrs += group * stride_xsg
    ws_ptrs = WS + (offs_n // GROUP_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K * KSUB)):
        for j in tl.static_range(KSUB):
            kb = step * KSUB + j
            kmask = offs_k < K - kb * BLOCK_K  # all false past K: zero values, and no scale read there
            x = tl.load(x_ptrs + j * BLOCK_K, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs + j * BLOCK_K, mask=nmask[:, None] & kmask[None, :], other=0.0)
            x_scale = tl.load(xs_ptrs + kb * stride_xsk, mask=mmask & (offs_m * 0 + kb * BLOCK_K < K), other=0.0)
            w_scale = tl.load(ws_ptrs + kb, mask=nmask & (offs_n * 0 + kb * BLOCK_K < K), other=0.0)
            if IS_INTERPRETED:  # the interpreter dots exact fp32 copies of the e4m3 values
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                part = tl.dot(x, tl.trans(w))
            acc += part * x_scale[:, None] * w_scale[None, :]
        x_ptrs += BLOCK_K * KSUB
        w_ptrs += BLOCK_K * KSUB
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


TILED_CONFIGS = [
    triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8), num_warps=w, num_stages=s)
    for bm, bn, w, s in ((64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
                         (32, 128, 4, 4), (16, 128, 4, 4), (16, 64, 4, 5))
]
"""Path B's autotuned tiles, keyed by (M bucket, N, K): up to 128 x 256 with 8 warps for prefill, narrow ones for
small M. A config whose tile does not fit shared memory is pruned by the autotuner (OutOfResources)."""

INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=4)

_TILED_KEY = ["M_BUCKET", "N", "K", "BLOCK_K", "KSUB"]
_fp8_tiled_gemm_tuned = triton.autotune(TILED_CONFIGS, key=_TILED_KEY)(_fp8_tiled_gemm_kernel)
_fp8_tiled_grouped_tuned = triton.autotune([c for c in TILED_CONFIGS if c.kwargs["BLOCK_N"] <= 128],
                                           key=_TILED_KEY)(_fp8_tiled_gemm_kernel)
"""The grouped form's autotuner (groups of a multiple of 128 rows): tiles up to 128 columns."""
GROUPED_TILE = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
"""The grouped form's tile where a group's rows are not a multiple of 128 (BLOCK_N cut to divide them)."""


def fp8_tiled_gemm(xq: torch.Tensor, x_scale: torch.Tensor, m: int, weight: torch.Tensor,
                   weight_scale_inv: torch.Tensor, group_n: int, block_k: int, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, config: dict | None = None, groups: int = 1,
                   k_step: int = TILED_K_STEP) -> torch.Tensor:
    """Path B: xq (>= m, K) float8_e4m3fn and x_scale (>= m, ceil(K/block_k)) float32 (any strides: fp8_quant's
    M-major layout) from deepinfer_kernels.fp8_quant, times weight (N, K) with its block scales -> (m, N)
    out_dtype. config: fixed BLOCK_M / BLOCK_N / GROUP_M / num_warps / num_stages instead of the autotuner (the
    interpreter test). groups > 1: grouped, as fp8_block_gemm's (xq (>= m, groups * K), K a multiple of
    block_k, so each group's activation scales are its own). k_step: inputs a step (TILED_K_STEP), a multiple of
    block_k; the same sums in the same order whatever it is."""
    rows = _group_rows(xq, weight, groups)
    k, n = weight.shape[1], weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1 and (groups == 1 or k % block_k == 0)
    assert xq.stride(1) == 1 and x_scale.shape[1] == triton.cdiv(groups * k, block_k)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    args = (xq, x_scale, weight, weight_scale_inv, bias if bias is not None else weight_scale_inv, y, m, n, k,
            m_bucket(m), xq.stride(0), k, x_scale.stride(0), x_scale.stride(1), k // block_k * x_scale.stride(1),
            weight.stride(0), weight_scale_inv.stride(0), y.stride(0))
    flags = dict(HAS_BIAS=bias is not None, GROUP_N=group_n, GROUP_ROWS=rows, BLOCK_K=block_k,
                 KSUB=max(1, k_step // block_k), IS_INTERPRETED=xq.device.type == "cpu")

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if config is None and xq.device.type == "cpu":
        config = INTERPRETER_TILE  # the interpreter has no timer to tune with
    if config is None and rows % 128:
        config = GROUPED_TILE
    if config is not None:
        config = dict(config, BLOCK_N=group_tile_n(config["BLOCK_N"], rows)) if rows else config
        _fp8_tiled_gemm_kernel[grid(config)](*args, **flags, **config)
    else:
        (_fp8_tiled_grouped_tuned if rows else _fp8_tiled_gemm_tuned)[grid](*args, **flags)
    return y


INVARIANT_TILE = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)
"""Batch-invariant mode's one tile of the tiled GEMM (one of TILED_CONFIGS), whatever the row count."""


def _quantized_tiled_gemm(x2: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int,
                          block_k: int, bias: torch.Tensor | None, config: dict | None = None,
                          groups: int = 1) -> torch.Tensor:
    """x2 (M, K) quantized per row and block_k group (fp8_quant), then the tiled GEMM (config: fixed tiles, or the
    autotuner's; groups: fp8_tiled_gemm's) -> (M, N) in x2's dtype."""
    xq, xs = quantize_fp8_token_groups(x2, block_k)
    return fp8_tiled_gemm(xq, xs, x2.shape[0], weight, weight_scale_inv, group_n, block_k, x2.dtype, bias, config,
                          groups)


def fp8_invariant_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int,
                       block_k: int, bias: torch.Tensor | None = None, groups: int = 1) -> torch.Tensor:
    """y = x @ dequant(weight).T with each row's result bitwise the same whatever other rows x holds (batch-
    invariant mode): activations quantized per row (fp8_quant), then the tiled GEMM with INVARIANT_TILE: no
    autotuning, no row-count-dependent path or split, each row's dot over the same K steps. groups: grouped, as
    fp8_block_gemm's."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    config = INTERPRETER_TILE if x.device.type == "cpu" else INVARIANT_TILE
    y = _quantized_tiled_gemm(x2, weight, weight_scale_inv, group_n, block_k, bias, config, groups)
    return y.view(*x.shape[:-1], n)


# ---- the path switch (DEEPINFER_FP8_GEMM, read where the layer's method is built) ----

FP8_GEMM_PATHS = ("triton", "scaled_mm", "tiled", "gemv", "w16", "dequant", "auto")
"""triton: the fused kernel above (activations quantized in every N tile); scaled_mm: path A (torch's block-scaled
GEMM, the tiled path for shapes it does not take); tiled: path B; gemv: deepinfer_kernels.fp8_gemv, the CUDA-core
form, up to fp8_gemv.GEMV_MAX_ROWS rows, grouped too (more rows take auto's path); w16: deepinfer_kernels.fp8_w16,
the weight tile dequantized in registers times 16-bit activations (not grouped: a grouped GEMM takes auto's path);
dequant: deepinfer_kernels.fp8_dequant, the whole weight dequantized into scratch, then torch's 16-bit GEMM (the
same numbers as w16; not grouped either); auto: auto_path (rows, output width, blocks; GROUPED_AUTO_PATH for a
grouped GEMM)."""

AUTO_PATHS: tuple[tuple[int, str], ...] = ((1, "tiled"), (1 << 62, "scaled_mm"))
"""(largest M, path) rows, first match wins: `auto`'s choice (the default), from an H200 run of
`benchmark/bench_fp8_gemm.py` (results/gpu_fp8_gemm_h200.json, V2-Lite and V3 shapes, M = 1 / 64 / 2048 / 8192).
At M >= 2048 scaled_mm reads 0.72-0.89 of the FP8 rate (tiled 0.35-0.50, the fused kernel 0.18-0.27) and beats
cuBLAS bf16 on the dequantized weight by 1.3-1.6x. At M = 64 it takes 0.72-0.79 of cuBLAS bf16's time on the V3
shapes (49.6 against 63.9 us on o_proj). At M = 1 the tiled path wins on most shapes. Where scaled_mm does not
take a GEMM (N or K not a multiple of 128, 32 x 32 blocks) the tiled path runs it, and at M <= 64 that is 1.7-2.3x
cuBLAS bf16's time (V2-Lite's dense down, K = 10944: 33.5 against 14.3 us): zero-padding such weights to 128 at
load would give them scaled_mm. (That run's floor used a low copy bandwidth and weights small enough to stay in
L2, so its decode fractions of the floor read high; the benchmark now takes the read bandwidth and rotates weight
copies past L2.) On an H100 (results/gpu_fp8_gemm_gemv_h100.json) every path
takes 9-12 us at one row on V2-Lite's shapes whose floor is 1.4-3.8 us: too few output tiles, each a chain of 16
dependent K steps. The fused path now splits K at up to SPLIT_K_MAX_ROWS rows (split_k_for) to answer that.

An H100 run at M = 1 / 16 (results/gpu_fp8_gemm_h100.json) splits the choice by N: where N <= SPLIT_AUTO_MAX_N the
split fused kernel is the fastest path or within 3% of it (V2-Lite's fused qkv_a at one row: 9.8 against tiled 9.5;
dense down 17.1 us against tiled 35.3, o_proj 7.1 against 9.2,
shared down 8.4 against 11.9 and scaled_mm 15.4; V3's fused qkv_a 13.0 against 22.8; at 16 rows the same order),
few N tiles being what held the others back; at larger N (gate_up, q_b, V3's 7168-wide outputs) the tiled path
or scaled_mm stays ahead (V2-Lite's dense gate_up 20.4 tiled against 27.3), so AUTO_PATHS keeps them."""

SPLIT_AUTO_MAX_N = 4096
"""Widest output `auto` sends to the split fused kernel at up to SPLIT_K_MAX_ROWS rows (128 x 128 blocks)."""
NARROW_BLOCK_PATH = "w16"
"""`auto`'s path past GEMV_AUTO_MAX_ROWS for weights whose scale blocks are narrower than a K step (V4.1's 32 x 32):
the weight tile dequantized in registers (deepinfer_kernels.fp8_w16). On an H100 at V4.1-Flash's projections
(results/gpu_fp8_gemm_w16_h100.json) it took 0.58-0.78x the tiled W8A8 kernel's time at 64 rows and 0.70-0.92x at
256, and the V4.1-Flash decode step 8.63 against 9.01 ms at batch 64 and 13.46 against 13.94 at 256
(results/v4_sweep_h100_v41_w16.json). bf16 cuBLAS on the dequantized weight is still faster at 256 rows (0.3-0.5x
w16's time), at twice the bytes held."""
NARROW_BLOCK_MAX_ROWS = 256
"""The most rows NARROW_BLOCK_PATH takes (the most it was timed at); prefill chunks past it keep AUTO_PATHS."""
GEMV_AUTO_MAX_ROWS = 1
"""Rows `auto` sends to the GEMV form (deepinfer_kernels.fp8_gemv). At one row on an H100
(benchmark/results/gpu_fp8_gemm_gemv_v41_h100.json) it took 8.6 / 18.6 / 7.6 / 22.6 / 15.9 / 10.4 us on V4.1-Flash's
wq_a / wq_b / wkv / wo_b / shared gate_up / shared down (32 x 32 blocks) against 36.0 / 23.0 / 36.2 / 59.3 / 37.8 /
19.5 for the tiled path those blocks took before, and on 128 x 128 blocks it was the fastest path or within 3% of it
(V4-Flash's wq_a / wq_b / wo_b 7.5 / 15.4 / 17.6 against 8.5 / 16.2 / 20.2). At four rows it re-reads each weight
tile from L2 per row and loses on the wide ones (V4.1's wq_b 35.7 against tiled 23.9)."""


def auto_path(m: int, n: int = 1 << 62, block: tuple[int, int] = (128, 128),
              split_rows: int = SPLIT_K_MAX_ROWS) -> str:
    """`auto`'s path for an M x N GEMM of `block` (rows, columns) scale blocks: the GEMV form at up to
    GEMV_AUTO_MAX_ROWS rows, the split fused kernel for up to split_rows rows and narrow outputs (measured at 128 x
    128 blocks), NARROW_BLOCK_PATH for scale blocks narrower than a K step at up to NARROW_BLOCK_MAX_ROWS rows, else
    AUTO_PATHS."""
    if m <= GEMV_AUTO_MAX_ROWS:
        return "gemv"
    if m <= split_rows and n <= SPLIT_AUTO_MAX_N and block == (128, 128):
        return "triton"
    if block[1] < TILED_K_STEP and m <= NARROW_BLOCK_MAX_ROWS:
        return NARROW_BLOCK_PATH
    return next(path for largest, path in AUTO_PATHS if m <= largest)


GROUPED_AUTO_PATH = "tiled"
"""`auto`'s path for a grouped GEMM: on an H100 at V4-Flash's wo_a (8 x 1024 x 4096, 128 x 128 blocks;
benchmark/results/gpu_fp8_gemm_grouped_h100.json) the tiled kernel took 18.2 / 21.5 / 31.0 / 41.3 µs at 1 / 16 / 64
/ 256 rows, the split fused kernel 22.0 / 22.1 / 55.8 / 57.1."""


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int, block_k: int,
             bias: torch.Tensor | None = None, path: str = "auto", split_sum: str = "kernel",
             pdl: bool = False, groups: int = 1, split_rows: int = SPLIT_K_MAX_ROWS) -> torch.Tensor:
    """y = x @ dequant(weight).T through `path` (one of FP8_GEMM_PATHS); the arguments as fp8_block_gemm's.
    scaled_mm on a GEMM it does not take (scaled_mm_shape_unsupported), or where the build or device lacks it
    under `auto`, runs the tiled path; an explicit scaled_mm on a build or device without it raises. pdl: the
    fused and GEMV paths' launches as programmatic dependent ones (the other paths launch as before). groups > 1:
    grouped (fp8_block_gemm's); `auto` and scaled_mm run it on the tiled path (GROUPED_AUTO_PATH). split_rows: the most
    rows `auto` sends to the split fused kernel and that kernel splits K at (DEEPINFER_FP8_SPLIT_ROWS)."""
    is_auto = path == "auto"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if is_auto or (path == "gemv" and rows > GEMV_MAX_ROWS) or (path in ("w16", "dequant") and groups > 1):
        path = GROUPED_AUTO_PATH if groups > 1 else auto_path(rows, weight.shape[0], (group_n, block_k), split_rows)
    if path == "gemv":
        return fp8_gemv(x, weight, weight_scale_inv, group_n, block_k, bias, pdl=pdl, groups=groups)
    if path == "w16":
        from deepinfer_kernels.fp8_w16 import fp8_w16_gemm

        return fp8_w16_gemm(x, weight, weight_scale_inv, group_n, block_k, bias)
    if path == "dequant":
        from deepinfer_kernels.fp8_dequant import fp8_dequant_gemm

        return fp8_dequant_gemm(x, weight, weight_scale_inv, group_n, block_k, bias)
    if path == "triton":
        return fp8_block_gemm(x, weight, weight_scale_inv, group_n, block_k, bias, split_sum=split_sum, pdl=pdl,
                              groups=groups, split_rows=split_rows)
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    if path == "scaled_mm":
        reason = scaled_mm_unsupported(x.device)
        if reason is not None and not is_auto:
            raise RuntimeError(f"DEEPINFER_FP8_GEMM=scaled_mm: {reason}")
        if reason is None and groups == 1 and scaled_mm_shape_unsupported(n, k, group_n, block_k, x.dtype) is None:
            xq, xs = quantize_fp8_token_groups(x2, block_k, SCALED_MM_ROW_MULTIPLE)
            return fp8_scaled_mm(xq, xs, m, weight, weight_scale_inv, x.dtype, bias).view(*x.shape[:-1], n)
    elif path != "tiled":
        raise ValueError(f"FP8 GEMM path {path!r} is not one of {FP8_GEMM_PATHS}")
    y = _quantized_tiled_gemm(x2, weight, weight_scale_inv, group_n, block_k, bias, groups=groups)
    return y.view(*x.shape[:-1], n)
