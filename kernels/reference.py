"""Torch reference ops: the simple path every fast kernel is checked against."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as the HF reference does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2d) = [gate | up] -> silu(gate) * up (..., d)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """x (T, H, D), cos/sin (T, D) in the half-split layout [f0..f_{D/2-1}, f0..f_{D/2-1}].

    interleave=True: x's rotary dims come in adjacent pairs (x0, x1), (x2, x3)... (DeepSeek checkpoints);
    they are de-interleaved first, which gives the same result as rotating the pairs in place, in the
    half-split layout the HF reference returns.
    """
    if interleave:
        t, h, d = x.shape
        x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


# ---- block-scaled FP8 (DeepSeek-V3/R1 checkpoints) ----

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: a block's amax maps onto it (scale_inv = amax / 448)."""
_FP8_MIN_AMAX = 1e-12
"""A block of zeros gets this amax (a tiny scale) instead of a 0 / 0."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K) -> (float8_e4m3fn (..., N, K), scale_inv float32 (..., ceil(N/bn), ceil(K/bk))): each
    bn x bk block divided by amax / 448, so that fp8 value x scale_inv approximates w (the V3 release format).
    Edge blocks cover what is left of N and K."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = w.new_zeros(*lead, nb * bn, kb * bk, dtype=torch.float32)
    padded[..., :n, :k] = w
    tiles = padded.view(*lead, nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=_FP8_MIN_AMAX)  # (..., nb, kb)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which can differ from
    # the CPU's quotient in the last bit; the scales must not depend on where a checkpoint was quantized.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale


def expand_block_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """scale_inv (..., ceil(N/bn), ceil(K/bk)) -> (..., N, K): each element's block scale."""
    n, k = shape
    return scale_inv.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 (or exactly cast) values (..., N, K) x their block's scale, in fp32, rounded once to `dtype`."""
    scale = expand_block_scales(scale_inv.float(), tuple(q.shape[-2:]), block)
    return (q.float() * scale).to(dtype)


def quantize_fp8_token_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (float8_e4m3fn (M, K), scale float32 (M, ceil(K/group))): per token and per `group` channels,
    scale = amax / 448 (the dynamic activation scheme)."""
    q, scale = quantize_fp8_blocks(x, (1, group))
    return q, scale


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The W8A8 block GEMM's torch form: x (M, K) quantized per token and block[1]-channel group, times w (N, K)
    fp8 with per-block scales, every product and sum in fp32 -> (M, N) fp32."""
    xq, xs = quantize_fp8_token_groups(x, block[1])
    return dequantize_fp8_blocks(xq, xs, (1, block[1])) @ dequantize_fp8_blocks(w, w_scale_inv, block).t()


def fused_moe_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                  down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The torch form of deepinfer_kernels.fused_moe_fp8: per (token, slot) pair, x quantized per token and
    bk-channel group times the dequantized gate / up rows (fp32), h = silu(gate) * up rounded to x's dtype, h
    quantized per pair and group times the dequantized down, times the top-k weight; slots summed in order."""
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    bn, bk = block
    rows = _cdiv(inter, bn)
    gate = dequantize_fp8_blocks(gate_up[:, :inter], gate_up_scale[:, :rows], block)
    up = dequantize_fp8_blocks(gate_up[:, inter:], gate_up_scale[:, rows:], block)
    down_w = dequantize_fp8_blocks(down, down_scale, block)

    def quantized(a: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_blocks(*quantize_fp8_token_groups(a, bk), (1, bk))

    t, k = ids.shape
    flat = ids.flatten()
    xq = quantized(x.float())[torch.arange(t, device=x.device).repeat_interleave(k)]  # (T*k, H)
    g = torch.einsum("ph,pih->pi", xq, gate[flat])
    u = torch.einsum("ph,pih->pi", xq, up[flat])
    h = (g / (1.0 + torch.exp(-g)) * u).to(x.dtype)
    y = torch.einsum("pi,phi->ph", quantized(h.float()), down_w[flat]) * weights.flatten().float()[:, None]
    y = y.to(x.dtype).float().view(t, k, hidden)
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out.to(x.dtype)


def stable_topk_keys(scores: torch.Tensor) -> torch.Tensor:
    """stable_topk's int64 keys of fp32 `scores` along the last dim: the score's order-preserving int32 bits
    above the complement of the index (distinct keys; a larger key is a larger score, or an equal one earlier)."""
    scores = scores.float() + 0.0  # -0.0 + 0.0 == +0.0: the two zeros get one key
    bits = scores.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # signed order == float order
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - index)


NEG_INF_KEYS = (-2139095041 + 1) * (1 << 32)
"""Keys below this are those of -inf scores (-inf's ordered bits are -2139095041)."""


def topk_of_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the min(k, E) largest stable_topk_keys along the last dim, best first, -1 for -inf scores: the
    picks of stable_topk(scores, k) masked where its values are -inf."""
    values, picks = keys.topk(min(k, keys.shape[-1]), dim=-1)
    return picks.masked_fill(values < NEG_INF_KEYS, -1)


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of fp32 `scores` along the last dim, ties to the lower index (the order of a stable
    descending sort), as (values, indices), best first. One topk over int64 keys that cannot tie: the score's
    order-preserving int32 bits above the complement of the index. -0.0 counts as +0.0 (as a sort compares them);
    NaN is not expected (scores are sums of finite products or -inf)."""
    k = min(k, scores.shape[-1])
    picks = stable_topk_keys(scores).topk(k, dim=-1).indices
    return scores.float().gather(-1, picks), picks


def paged_decode_attention_ref(q, k_buf, v_buf, page_table, table_rows, seq_lens, page_size, scale, k_scale=None,
                               v_scale=None):
    """Torch reference of paged_decode_attention (fp32 softmax), one sequence at a time; float8 buffers are
    dequantized by their row scales first."""
    bsz, hq, _ = q.shape
    out = q.new_zeros(bsz, hq, v_buf.shape[-1])
    for b in range(bsz):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = page_table[int(table_rows[b])][pos // page_size].long() * page_size + pos % page_size
        k, v = k_buf[slots].float(), v_buf[slots].float()
        if k_scale is not None:
            k, v = k * k_scale[slots][..., None], v * v_scale[slots][..., None]
        k = k.repeat_interleave(hq // k_buf.shape[1], dim=1)  # (n, Hq, D)
        v = v.repeat_interleave(hq // v_buf.shape[1], dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out
