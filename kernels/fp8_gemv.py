"""Block-scaled FP8 products for a few rows on the CUDA cores: y = x @ dequant(w).T at decode batch sizes.

At one row the tensor-core paths of fp8_gemm spend a step per scale block: V4.1-Flash's 32 x 32 blocks make every K
step of the tiled path 32 columns, and in a V4.1-Flash decode step at batch 1 its projections took 34 us each,
about a quarter of the read bandwidth (H100 profile, benchmark/README.md). Here a program streams BLOCK_N weight
rows x KC columns a step (KC a multiple of the block), converts the e4m3 codes to fp32, multiplies them by the
activations quantized as the other paths quantize them (fp8_quant.quantize_fp8_token_groups: per token and per
block_k columns, so the products are the same exact fp32 numbers), sums each scale block's products, scales them by
the activation's and the weight block's scales and adds them to its fp32 sum:

    y[m, n] = sum_b s_x[m, b] * s_w[n / GROUP_N, b] * sum_{k in b} q(x)[m, k] * w[n, k]

K is split over programs (about four per multiprocessor) and the fp32 partials added in split order by
fp8_split._split_k_sum_kernel, so a row's result does not depend on the other rows. The rows are a grid axis:
each row's programs read the same weight tile, from L2 after the first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait
from deepinfer_kernels.fp8_quant import interpreted_e4m3, quantize_fp8_token_groups, quantize_groups
from deepinfer_kernels.fp8_split import _group_rows, _split_k_sum_kernel, group_tile_n

GEMV_MAX_ROWS = 4
"""Most rows the GEMV form takes (each row re-reads the weight tile from L2)."""
GEMV_TILE = dict(BLOCK_N=32, KC=256, num_warps=4, num_stages=3)
GEMV_QUANTIZE = "launch"
"""Where the GEMV form quantizes its activations: 'launch' (fp8_quant's kernel first, one launch more a GEMM) or
'kernel' (each program its own columns, inside the GEMV kernel: the same products, bitwise). 'launch' until the
two are timed against each other on a GPU (bench_fp8_gemm.py's gemv_kernel_quant column)."""


@triton.jit
def _fp8_gemv_kernel(XQ, XS, W, WS, P, Y, N, K, k_per_split, stride_xm, stride_xsm, stride_xsk, stride_wn,
                     stride_wsn, stride_ym, BLOCK_N: tl.constexpr, KC: tl.constexpr, BK: tl.constexpr,
                     GROUP_N: tl.constexpr, GROUP_ROWS: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
                     QUANT: tl.constexpr = False, IS_INTERPRETED: tl.constexpr = False):
    """Program (row m, n tile, split s): columns [s * k_per_split, (s + 1) * k_per_split) of row m's products.
    DIRECT (one split, no bias) writes Y, else the fp32 partial to P (splits, M, N). GROUP_ROWS > 0: grouped (output
    rows [g * GROUP_ROWS, (g + 1) * GROUP_ROWS) read x's g-th K columns and their scales; BLOCK_N divides it).
    QUANT: XQ is x as it is (XS unread) and each step quantizes its KC columns here, as
    fp8_quant._quantize_token_groups_kernel does (splits and steps start on a group), so the products are the same."""
    pdl_wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    G: tl.constexpr = KC // BK
    k0 = pid_s * k_per_split
    k1 = tl.minimum(K, k0 + k_per_split)
    offs_k = tl.arange(0, KC)
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k0 + offs_k[None, :]
    ws_ptrs = WS + (offs_n // GROUP_N).to(tl.int64)[:, None] * stride_wsn + k0 // BK + tl.arange(0, G)[None, :]
    x0 = k0
    if GROUP_ROWS > 0:
        x0 += (pid_n * BLOCK_N // GROUP_ROWS) * K
    x_ptrs = XQ + m * stride_xm + x0 + offs_k
    xs_ptrs = XS + m * stride_xsm + (x0 // BK + tl.arange(0, G)) * stride_xsk
    acc = tl.zeros([BLOCK_N], tl.float32)
    for kc in range(k0, k1, KC):
        kmask = offs_k < k1 - kc
        gmask = tl.arange(0, G) * BK < k1 - kc
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        if QUANT:
            v, xs = quantize_groups(tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32).reshape(G, BK))  # xs (G,)
            if IS_INTERPRETED:
                x = interpreted_e4m3(v).reshape(KC)
            else:
                x = v.to(tl.float8e4nv).to(tl.float32).reshape(KC)
        else:
            x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            xs = tl.load(xs_ptrs, mask=gmask, other=0.0)
        blocks = tl.sum((w * x[None, :]).reshape(BLOCK_N, G, BK), axis=2)  # (BLOCK_N, G) exact products' sums
        ws = tl.load(ws_ptrs, mask=nmask[:, None] & gmask[None, :], other=0.0)
        acc += tl.sum(blocks * ws * xs[None, :], axis=1)
        w_ptrs += KC
        ws_ptrs += G
        x_ptrs += KC
        xs_ptrs += G * stride_xsk
    if DIRECT:
        tl.store(Y + m * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=nmask)
    else:
        tl.store(P + (pid_s * tl.num_programs(0) + m) * N + offs_n, acc, mask=nmask)


def gemv_split_for(m: int, n: int, k: int, block_n: int, kc: int, num_sms: int) -> int:
    """Splits of K: about four programs a multiprocessor over the rows and N tiles, each split at least two steps
    of kc columns."""
    tiles = m * triton.cdiv(n, block_n)
    want = max(1, 4 * num_sms // tiles)
    return max(1, min(want, triton.cdiv(k, 2 * kc)))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int, block_k: int,
             bias: torch.Tensor | None = None, config: dict | None = None, split_k: int | None = None,
             pdl: bool = False, groups: int = 1, quantize: str | None = None) -> torch.Tensor:
    """x (..., K) 16/32-bit with at most GEMV_MAX_ROWS rows, weight (N, K) float8_e4m3fn, weight_scale_inv
    (ceil(N / group_n), ceil(K / block_k)) float32 -> (..., N) in x's dtype; the values of fp8_gemm's paths (the
    same quantized activations and exact products, fp32 sums in another order). config: BLOCK_N, KC (a multiple of
    block_k), num_warps, num_stages (default GEMV_TILE). split_k: None = gemv_split_for on the GPU, 1 elsewhere.
    pdl: its launches as programmatic dependent ones. groups > 1: a block-diagonal (grouped) product as
    fp8_gemm.fp8_block_gemm's (x (..., groups * K), weight (groups * R, K), K a multiple of block_k). quantize:
    GEMV_QUANTIZE's choice for this call (None: GEMV_QUANTIZE)."""
    k, n = weight.shape[1], weight.shape[0]
    rows = _group_rows(x, weight, groups)
    x2 = x.reshape(-1, groups * k)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}")
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or (groups > 1 and k % block_k):
        raise ValueError(f"fp8_gemv: weight {tuple(weight.shape)} {weight.dtype} for {groups} x {k} inputs in blocks "
                         f"of {block_k}")
    if tuple(weight_scale_inv.shape) != (triton.cdiv(n, group_n), triton.cdiv(k, block_k)):
        raise ValueError(f"fp8_gemv: scales {tuple(weight_scale_inv.shape)} for a {n} x {k} weight in {group_n} x "
                         f"{block_k} blocks")
    kc_default = config is None
    config = dict(config or GEMV_TILE)
    block_n, kc = config.pop("BLOCK_N"), config.pop("KC")
    if kc_default:
        kc = max(kc, block_k)  # blocks wider than the default step (powers of two): one block a step
    if rows:
        block_n = group_tile_n(block_n, rows)
    if kc % block_k:
        raise ValueError(f"fp8_gemv: KC {kc} must be a multiple of the block {block_k}")
    y = x.new_empty(m, n)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    quantize = GEMV_QUANTIZE if quantize is None else quantize
    if quantize not in ("launch", "kernel"):
        raise ValueError(f"fp8_gemv: quantize {quantize!r} is not 'launch' or 'kernel'")
    in_kernel = quantize == "kernel"
    if in_kernel:
        xq = x2 if x2.stride(1) == 1 else x2.contiguous()
        xs = weight_scale_inv  # not read
    else:
        xq, xs = quantize_fp8_token_groups(x2, block_k, pdl=pdl)
    if split_k is None:
        split_k = 1 if x.device.type != "cuda" else gemv_split_for(
            m, n, k, block_n, kc, torch.cuda.get_device_properties(x.device).multi_processor_count)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), kc) * kc
    split_k = triton.cdiv(k, k_per_split)  # no empty split
    direct = split_k == 1 and bias is None
    part = y if direct else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(m, triton.cdiv(n, block_n), split_k)](
        xq, xs, weight, weight_scale_inv, part, y, n, k, k_per_split, xq.stride(0), xs.stride(0), xs.stride(1),
        weight.stride(0), weight_scale_inv.stride(0), y.stride(0), BLOCK_N=block_n, KC=kc, BK=block_k,
        GROUP_N=group_n, GROUP_ROWS=rows, DIRECT=direct, QUANT=in_kernel, IS_INTERPRETED=x.device.type == "cpu",
        **config, **pdl_launch(pdl))
    if not direct:  # partials added in split order, the bias in fp32 before the one rounding
        block = min(1024, triton.next_power_of_2(n))
        _split_k_sum_kernel[(m, triton.cdiv(n, block))](part, bias if bias is not None else weight_scale_inv, y, m,
                                                         n, y.stride(0), HAS_BIAS=bias is not None, SPLIT_K=split_k,
                                                         BLOCK=block, **pdl_launch(pdl))
    return y.view(*x.shape[:-1], n)
