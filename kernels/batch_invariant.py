"""Batch-invariant Triton kernels (GPU; also run by Triton's interpreter on CPU with TRITON_INTERPRET=1).

Each output element is reduced in one fixed order that depends only on the problem's inner sizes, never on the
number of rows: one tile configuration for every M (no autotuning by shape), no split-K, and one program per
row for the norms. `deepinfer_rt.layers.batch_invariant` dispatches here for CUDA tensors.

    matmul        persistent GEMM: programs walk the output tiles in a grid-stride loop, each tile owning the
                  whole K loop in BLOCK_K steps, so a row's result is the same for M = 1 or M = 4096. The tile
                  configuration depends on the dtype and N (the weight), never on M; tiles are visited in
                  GROUP_M-row bands so programs running together share weight columns in L2 (which program
                  computes a tile does not change it)
    head_matmul   per-head matmul (MLA's absorbed projections) in one launch: one tile of one head per program,
                  the matmul's tiles, the whole K loop
    rms_norm      one program per row, the row's sum of squares in one fixed-width block reduction
    silu_and_mul  elementwise, silu as x / (1 + exp(-x))
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_M = 8


def _matmul_config(dtype: torch.dtype, n: int) -> dict:
    """Tiles and pipelining per dtype and output width, never per M (the row count). 16-bit: tensor-core tiles
    with a 3-deep load pipeline (the usual Hopper GEMM shape); fp32 takes full-precision products, whose
    register cost wants smaller tiles. Narrow weights (N below 4096 / 1024) get narrower column tiles, so that
    a decode step's few rows still spread over more than N/128 programs."""
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64 if n >= 1024 else 16, BLOCK_K=32, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128 if n >= 4096 else 64, BLOCK_K=64, num_warps=8, num_stages=3)


@triton.jit
def _tile_dot(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_FP32: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) tile of a[rm] @ b[:, rn], the whole K loop in BLOCK_K steps (no split-K)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IS_FP32:  # full fp32 products, not TF32: fp32 runs stay comparable to the CPU reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                   stride_cn, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IS_FP32: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        band, local = tile // (GROUP_M * num_n), tile % (GROUP_M * num_n)  # GROUP_M row tiles x all columns
        band_rows = tl.minimum(num_m - band * GROUP_M, GROUP_M)  # the last band may be shorter
        rm = (band * GROUP_M + local % band_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (local // band_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_dot(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N,
                        BLOCK_K, IS_FP32)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) -> (M, N) in a's dtype, accumulated in fp32."""
    m, k = a.shape
    n = b.shape[1]
    c = a.new_empty(m, n)
    if m == 0:
        return c
    programs = _num_programs(a.device)
    _matmul_kernel[(programs,)](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                c.stride(0), c.stride(1), NUM_PROGRAMS=programs, GROUP_M=GROUP_M,
                                IS_FP32=a.dtype == torch.float32, **_matmul_config(a.dtype, n))
    return c


@triton.jit
def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                stride_cb, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, IS_FP32: tl.constexpr):
    """One (BLOCK_M x BLOCK_N) tile of one batch entry per program, the whole K loop in BLOCK_K steps."""
    tile, batch = tl.program_id(0), tl.program_id(1).to(tl.int64)
    num_n = tl.cdiv(N, BLOCK_N)
    rm = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptr += batch * stride_ab
    b_ptr += batch * stride_bb
    acc = _tile_dot(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N,
                    BLOCK_K, IS_FP32)
    tl.store(c_ptr + batch * stride_cb + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head x (T, H, A) @ w (H, A, B) -> (T, H, B) in one launch (MLA's absorbed projections), each row
    the same for any T: the tiles of `matmul` for the dtype, no split-K. Strided inputs are read in place."""
    t, h, a = x.shape
    b = w.shape[2]
    out = x.new_empty(t, h, b)
    if t == 0:
        return out
    cfg = _matmul_config(x.dtype, b)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (triton.cdiv(t, bm) * triton.cdiv(b, bn), h)
    _bmm_kernel[grid](x, w, out, t, b, a, x.stride(1), x.stride(0), x.stride(2), w.stride(0), w.stride(1),
                      w.stride(2), out.stride(1), out.stride(0), out.stride(2), BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=cfg["BLOCK_K"], IS_FP32=x.dtype == torch.float32, num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"])
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x * inv).to(out_ptr.dtype.element_ty) * w
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, fp32 statistics, cast back before the weight (as the torch reference)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, shape[-1], x2.stride(0), out.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(shape[-1]))
    return out.view(shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2d) = [gate | up] -> silu(gate) * up (..., d)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    out = x2.new_empty(x2.shape[0], d)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, x2.stride(0), out.stride(0),
                                                                  BLOCK=block)
    return out.view(*x.shape[:-1], d)
