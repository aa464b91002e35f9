"""Row-wise Triton kernels: RMSNorm (optionally fused with the residual add), rotary embedding in place,
SiLU-and-mul, and the KV-store scatter. Each replaces a chain of small torch ops by one launch, which is
what decode at small batch is bound by. Numerics follow `reference`: fp32 math, rounding to the model dtype
where the reference rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait


@triton.jit
def _rms_normed(x, W, offs, mask, n_cols, eps):
    """w * norm(x) in fp32 for one row x (its own dtype, 0 past n_cols): x / rms(x) rounded to x's dtype, as the
    reference rounds, then scaled by the weight."""
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    xn = (xf * inv).to(x.dtype).to(tl.float32)
    return tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) * xn


@triton.jit
def _rotated(ptrs, offs_j, mask, cos, sin, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The rotary pairs at ptrs, rotated, in fp32: (x1 cos - x2 sin, x2 cos + x1 sin) for the pairs (x[2j],
    x[2j+1]) when INTERLEAVE, else (x[j], x[j + HALF]); the caller writes them half-split, as the reference does."""
    if INTERLEAVE:
        x1 = tl.load(ptrs + 2 * offs_j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + 2 * offs_j + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(ptrs + offs_j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + HALF + offs_j, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rms_norm_kernel(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x + tl.load(R + row * stride_r + offs, mask=mask, other=0.0)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    tl.store(Out + row * stride_o + offs, _rms_normed(x, W, offs, mask, n_cols, eps).to(Out.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pdl: bool = False):
    """x (T, D) rows with unit column stride. Without residual: norm(x). With it: (norm(x + residual),
    x + residual) -- the sum is what the next residual add starts from. pdl: a programmatic dependent launch."""
    if x.stride(-1) != 1 or x.dim() != 2:
        raise ValueError("rms_norm kernel takes 2-D rows with unit column stride")
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(t,)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                           res_out.stride(0), d, eps, BLOCK=block, HAS_RES=residual is not None,
                           num_warps=4 if block <= 4096 else 8, **pdl_launch(pdl))
    return out if residual is None else (out, res_out)


@triton.jit
def _rope_kernel(X, Positions, Cos, Sin, stride_xt, stride_xh, num_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_j = tl.arange(0, HALF)
    cos = tl.load(Cos + pos * HALF + offs_j)[None, :]
    sin = tl.load(Sin + pos * HALF + offs_j)[None, :]
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h[:, None] < num_heads
    base = X + t * stride_xt + offs_h[:, None] * stride_xh
    r1, r2 = _rotated(base, offs_j[None, :], hmask, cos, sin, HALF, INTERLEAVE)
    tl.debug_barrier()  # every lane has read its row before any lane overwrites it (in place)
    tl.store(base + offs_j[None, :], r1.to(X.dtype.element_ty), mask=hmask)
    tl.store(base + HALF + offs_j[None, :], r2.to(X.dtype.element_ty), mask=hmask)


def rope_cache(inv_freq: torch.Tensor, scaling: float, max_positions: int, device: torch.device):
    """(cos, sin) tables (max_positions, D/2) fp32, the reference's fp32 arithmetic done once."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float().cpu()[None, :]
    return (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool) -> torch.Tensor:
    """Rotate x (T, H, D) in place (unit column stride) by the tables' rows at `positions`."""
    t, h, d = x.shape
    if x.stride(-1) != 1:
        raise ValueError("apply_rope_ needs a unit column stride")
    _rope_kernel[(t,)](x, positions, cos, sin, x.stride(0), x.stride(1), h, HALF=d // 2,
                       BLOCK_H=triton.next_power_of_2(h), INTERLEAVE=interleave, num_warps=1)
    return x


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + d + offs, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
    tl.store(Out + row * stride_o + offs, s * u, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2d) = [gate | up] -> silu(gate) * up (T, d)."""
    t, two_d = x.shape
    d = two_d // 2
    out = x.new_empty(t, d)
    block = min(1024, triton.next_power_of_2(d))
    _silu_mul_kernel[(t, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block)
    return out


@triton.jit
def _store_kv_kernel(Src, Dst, Slots, stride_src, stride_dst, n, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding rows (CUDA graphs): nothing to store
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(Dst + slot * stride_dst + offs, tl.load(Src + t * stride_src + offs, mask=mask), mask=mask)


def store_kv(buf: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """buf[slots[t]] = src[t] for slots >= 0; buf (slots, H, D) with (H, D) contiguous, src (T, H, D)."""
    t = src.shape[0]
    if src[0].numel() and not src[0].is_contiguous():
        src = src.contiguous()
    n = buf[0].numel()
    block = min(1024, triton.next_power_of_2(n))
    _store_kv_kernel[(t, triton.cdiv(n, block))](src, buf, slots, src.stride(0), buf.stride(0), n, BLOCK=block)


@triton.jit
def _round_to_e4m3(y):
    """y (fp32, within +-448) rounded to nearest even on e4m3's grid, in fp32, so that the cast after it is exact.
    The cast alone left stored bytes that differ from torch's conversion on the H200 (Triton's fp32 -> e4m3 path
    is not a single rounding everywhere). The grid step is 2^(e - 3) for y's binary exponent e >= -6 (3 mantissa
    bits) and 2^-9 below (subnormals); it comes from y's exponent bits, not from log2, which is approximate on
    the GPU. Adding and subtracting 1.5 * 2^23 rounds |y| / step (< 2^5) to the nearest even integer."""
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 121)  # 121 = 127 - 6
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    inv = ((254 - (exp - 3)) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
    n = (tl.abs(y) * inv + 12582912.0) - 12582912.0
    # y's sign bit put back by bit operations, so a negative that rounds to zero stays -0 as in torch's cast
    # (Triton's unary minus is 0 - x, which gives +0 there)
    return ((n * step).to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_fp8_kernel(Src, Dst, Scale, Slots, stride_st, stride_sh, stride_dt, stride_dh, stride_ct, d,
                         FP8_MAX: tl.constexpr, FP8_INV: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding rows (CUDA graphs): nothing to store
        offs = tl.arange(0, BLOCK)
        mask = offs < d
        x = tl.load(Src + t * stride_st + h * stride_sh + offs, mask=mask, other=0.0).to(tl.float32)
        # The same fp32 operations as KVPool.write's quantize_fp8_rows, so the stored bits are equal: amax times
        # fp32(1/448), an IEEE division by the scale, the clamp, round to nearest even on e4m3's grid.
        scale = tl.maximum(tl.max(tl.abs(x), 0) * FP8_INV, MIN_SCALE)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(Dst + slot * stride_dt + h * stride_dh + offs, _round_to_e4m3(y).to(Dst.dtype.element_ty), mask=mask)
        tl.store(Scale + slot * stride_ct + h, scale)


def store_kv_fp8(buf: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, src: torch.Tensor,
                 pdl: bool = False) -> None:
    """buf[slots[t]], scale[slots[t]] = quantize_fp8_rows(src[t]) for slots >= 0 (deepinfer_rt.cache.kv_pool):
    buf (slots, H, D) float8_e4m3fn with unit column stride, scale (slots, H) float32, src (T, H, D). pdl: as a
    programmatic dependent launch (dispatch.pdl_launch)."""
    from deepinfer_rt.cache.kv_pool import _MIN_SCALE, FP8_INV, FP8_MAX

    t, h, d = src.shape
    if src.stride(-1) != 1 or buf.stride(-1) != 1 or scale.stride(1) != 1 or buf.shape[1:] != src.shape[1:]:
        raise ValueError("store_kv_fp8 needs unit column strides and rows of the buffer's (heads, dim)")
    if t:
        _store_kv_fp8_kernel[(t, h)](src, buf, scale, slots, src.stride(0), src.stride(1), buf.stride(0),
                                     buf.stride(1), scale.stride(0), d, FP8_MAX=FP8_MAX, FP8_INV=FP8_INV,
                                     MIN_SCALE=_MIN_SCALE, BLOCK=triton.next_power_of_2(d), **pdl_launch(pdl))


@triton.jit
def _mla_rope_store_kernel(KVA, NormW, QPe, Positions, Cos, Sin, Pool, Slots, stride_kva, stride_qt, stride_qh,
                           stride_pool, num_heads, kv_rank, eps, BLOCK_C: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_j = tl.arange(0, HALF)
    cos = tl.load(Cos + pos * HALF + offs_j)
    sin = tl.load(Sin + pos * HALF + offs_j)
    # The query's rope part, every head, in place (as _rope_kernel).
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h[:, None] < num_heads
    q = QPe + t * stride_qt + offs_h[:, None] * stride_qh
    r1, r2 = _rotated(q, offs_j[None, :], hmask, cos[None, :], sin[None, :], HALF, INTERLEAVE)
    tl.debug_barrier()  # every lane has read its row before any lane overwrites it
    tl.store(q + offs_j[None, :], r1.to(QPe.dtype.element_ty), mask=hmask)
    tl.store(q + HALF + offs_j[None, :], r2.to(QPe.dtype.element_ty), mask=hmask)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding rows (CUDA graphs): nothing to store
        row = KVA + t * stride_kva
        dst = Pool + slot * stride_pool
        # The latent, normalised (as _rms_norm_kernel).
        offs_c = tl.arange(0, BLOCK_C)
        cmask = offs_c < kv_rank
        c = tl.load(row + offs_c, mask=cmask, other=0.0)
        tl.store(dst + offs_c, _rms_normed(c, NormW, offs_c, cmask, kv_rank, eps).to(Pool.dtype.element_ty),
                 mask=cmask)
        # The rope key, rotated (rounded to the model dtype as apply_rope_ rounds it in place).
        k1, k2 = _rotated(row + kv_rank, offs_j, offs_j < HALF, cos, sin, HALF, INTERLEAVE)
        tl.store(dst + kv_rank + offs_j, k1.to(KVA.dtype.element_ty).to(Pool.dtype.element_ty))
        tl.store(dst + kv_rank + HALF + offs_j, k2.to(KVA.dtype.element_ty).to(Pool.dtype.element_ty))


def mla_rope_store(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, q_pe: torch.Tensor,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                   pool: torch.Tensor, slots: torch.Tensor, pdl: bool = False) -> None:
    """MLA's per-token work between the projections and attention, in one launch: pool[slots[t]] =
    [rms_norm(latent) | rope(k_pe)] from kv_a (T, C + R) = [latent | k_pe], and q_pe (T, H, R) rotated in place.
    The same arithmetic as rms_norm, apply_rope_ and store_kv one after another (five launches, with the
    concatenation). pool (slots, 1, C + R); negative slots store nothing. pdl: a programmatic dependent launch."""
    t, h, r = q_pe.shape
    kv_rank = kv_a.shape[1] - r
    if kv_a.stride(1) != 1 or q_pe.stride(-1) != 1 or pool[0].numel() != kv_rank + r or not pool[0].is_contiguous():
        raise ValueError("mla_rope_store needs unit column strides and a pool row of C + R contiguous columns")
    if t:
        _mla_rope_store_kernel[(t,)](kv_a, norm_weight, q_pe, positions, cos, sin, pool, slots, kv_a.stride(0),
                                     q_pe.stride(0), q_pe.stride(1), pool.stride(0), h, kv_rank, eps,
                                     BLOCK_C=triton.next_power_of_2(kv_rank), HALF=r // 2,
                                     BLOCK_H=triton.next_power_of_2(h), INTERLEAVE=interleave, num_warps=4,
                                     **pdl_launch(pdl))


@triton.jit
def _rope_heads_(X, t, stride_xt, stride_xh, num_heads, cos, sin, offs_j, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Token t's heads of X rotated in place (as _rope_kernel); returns the rotated halves (fp32, rounded to X's
    dtype) and the head mask."""
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h[:, None] < num_heads
    base = X + t * stride_xt + offs_h[:, None] * stride_xh
    r1, r2 = _rotated(base, offs_j[None, :], hmask, cos, sin, HALF, INTERLEAVE)
    r1, r2 = r1.to(X.dtype.element_ty), r2.to(X.dtype.element_ty)
    tl.debug_barrier()  # every lane has read its row before any lane overwrites it (in place)
    tl.store(base + offs_j[None, :], r1, mask=hmask)
    tl.store(base + HALF + offs_j[None, :], r2, mask=hmask)
    return r1, r2, offs_h, hmask


@triton.jit
def _gqa_rope_store_kernel(Q, K, V, Positions, Cos, Sin, KBuf, VBuf, Slots, stride_qt, stride_qh, stride_kt,
                           stride_kh, stride_vt, stride_vh, stride_kb, stride_vb, num_q_heads, num_kv_heads,
                           HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                           INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_j = tl.arange(0, HALF)
    cos = tl.load(Cos + pos * HALF + offs_j)[None, :]
    sin = tl.load(Sin + pos * HALF + offs_j)[None, :]
    _rope_heads_(Q, t, stride_qt, stride_qh, num_q_heads, cos, sin, offs_j, HALF, BLOCK_HQ, INTERLEAVE)
    k1, k2, offs_h, hmask = _rope_heads_(K, t, stride_kt, stride_kh, num_kv_heads, cos, sin, offs_j, HALF,
                                         BLOCK_HK, INTERLEAVE)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding rows (CUDA graphs): nothing to store
        rows = offs_h[:, None] * (2 * HALF)  # a pool row's heads are contiguous
        kdst = KBuf + slot * stride_kb + rows
        tl.store(kdst + offs_j[None, :], k1.to(KBuf.dtype.element_ty), mask=hmask)
        tl.store(kdst + HALF + offs_j[None, :], k2.to(KBuf.dtype.element_ty), mask=hmask)
        offs_d = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=hmask, other=0.0)
        tl.store(VBuf + slot * stride_vb + rows + offs_d, v.to(VBuf.dtype.element_ty), mask=hmask)


def gqa_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, interleave: bool, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """A GQA layer's per-token work between the QKV projection and attention, in one launch: q (T, Hq, D) and
    k (T, Hkv, D) rotated in place, and k_buf[slots[t]] = k[t] (rotated), v_buf[slots[t]] = v[t] for slots >= 0.
    The same arithmetic as apply_rope_ on q and on k then store_kv of k and of v (four launches). Unit column
    strides; k_buf / v_buf (slots, Hkv, D) with contiguous rows; D a power of two."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if (any(x.stride(-1) != 1 for x in (q, k, v)) or k.shape != v.shape or d & (d - 1)
            or any(b.shape[1:] != k.shape[1:] or not b[0].is_contiguous() for b in (k_buf, v_buf))):
        raise ValueError("gqa_rope_store needs unit column strides, power-of-two heads, and pool rows of k's heads")
    if t:
        _gqa_rope_store_kernel[(t,)](q, k, v, positions, cos, sin, k_buf, v_buf, slots, q.stride(0), q.stride(1),
                                     k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_buf.stride(0),
                                     v_buf.stride(0), hq, hkv, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
                                     BLOCK_HK=triton.next_power_of_2(hkv), INTERLEAVE=interleave, num_warps=2)
