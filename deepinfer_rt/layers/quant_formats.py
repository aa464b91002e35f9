"""The quantized weight layouts of the DeepSeek-V4 / V4-Flash and V4.1 releases, by role, and their codecs.

What the releases store (read from transformers 5.24's DeepSeek-V4 config/modeling/conversion and fine-grained
FP8 integration, TensorRT-LLM's `_torch/models/modeling_deepseekv4.py` loader and `_torch/configs/deepseek_v41.py`
layout table, and the deepinfer 0.1.0 sdist's V4 loader):

    config.json   quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
                  scale_fmt: ue8m0, weight_block_size: [128, 128] (V4) | [32, 32] (V4.1)}; V4 ships
                  `expert_dtype: fp4` at the top level (transformers folds it into quantization_config),
                  V4.1 inside quantization_config. weight_block_size describes the DENSE role only.
    names         the reference code's (`inference/convert.py` style): embed.weight, head.weight, norm.weight,
                  hc_head_{fn,base,scale}, layers.N.{attn_norm,ffn_norm}.weight, layers.N.hc_{attn,ffn}_*,
                  layers.N.attn.{wq_a,q_norm,wq_b,wkv,norm,wo_a,wo_b,attn_sink,compressor.*,indexer.*},
                  layers.N.ffn.{gate.weight,gate.bias,gate.tid2eid,shared_experts.w{1,2,3},experts.E.w{1,2,3}},
                  mtp.*; a quantized linear's scale is `<module>.scale` beside `<module>.weight`.

    role     tensors                                  weight on disk           scale on disk
    DENSE    attention wq_a/wq_b/wkv/wo_a/wo_b,       float8_e4m3fn (N, K)     e8m0 (ceil(N/bn), ceil(K/bk)),
             indexer wq_b, shared experts w1/w2/w3                             (bn, bk) = weight_block_size
    EXPERT   routed ffn.experts.E.w{1,2,3}            int8 (N, K/2): MXFP4,    e8m0 (N, K/32): one exponent per
                                                      two e2m1 per byte, the   32 elements along K, so on disk
                                                      even element in the low  K/2 / (K/32) = 16 -- NVFP4's
                                                      nibble                   block: derive, never trust
    ENGRAM   V4.1 engram.embed tables (rows, D)       float8_e4m3fn            e8m0 (rows, D/32)
    kept     embed, head, norms, router weight (bf16), router bias (fp32), tid2eid (int), hyper-connection
             weights, attn_sink, compressor ape; V4-Flash's compressor wkv/wgate and indexer weights_proj and
             compressor are bf16 without a scale (transformers lists them in `_keep_in_fp32_modules`)

e8m0 (UE8M0) is an unsigned power of two: byte b means 2^(b - 127), 255 is NaN; checkpoints hold it as
float8_e8m0fnu or as raw uint8 bytes (both read here), V3.1-era ones as float32 powers of two. Dequantized weight
= value x 2^e exactly in fp32, so the FP8 linears keep the V3 path (float32 block scales, Fp8BlockLinear) and
the MXFP4 experts are dequantized at load (layers/mxfp4.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_kernels.reference import FP8_E4M3_MAX, dequantize_fp8_blocks, expand_block_scales

DENSE, EXPERT, ENGRAM = "dense", "expert", "engram"
ROLES = (DENSE, EXPERT, ENGRAM)
MX_BLOCK = 32
"""Elements per e8m0 scale along K for MXFP4 experts and along columns for Engram tables."""
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""e2m1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value."""
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E8M0_NAN = 255


@dataclass(frozen=True)
class Layout:
    """How one role's tensors lie on disk. `element_block` counts elements per scale; for a packed weight the
    on-disk ratio weight.shape / scale.shape reads `stored_block` (K halved by two e2m1 per byte)."""

    role: str
    storage_dtype: torch.dtype
    element_block: tuple[int, int]
    pack: int = 1
    """Elements per stored element along the last dim (2 for MXFP4)."""

    @property
    def stored_block(self) -> tuple[int, int]:
        return self.element_block[0], self.element_block[1] // self.pack

    @property
    def format(self) -> str:
        return "MXFP4 (e2m1, two per int8 byte)" if self.pack == 2 else "float8_e4m3fn"


def role_layouts(dense_block: tuple[int, int], expert_dtype: str) -> dict[str, Layout]:
    """The per-role layouts of a checkpoint whose quantization_config gives `dense_block` and `expert_dtype`
    ('fp4': MXFP4 experts; 'fp8': experts in the dense layout, as V3 and V4.1's `--expert-dtype fp8`)."""
    dense = Layout(DENSE, torch.float8_e4m3fn, dense_block)
    if expert_dtype == "fp4":
        expert = Layout(EXPERT, torch.int8, (1, MX_BLOCK), pack=2)
    elif expert_dtype == "fp8":
        expert = Layout(EXPERT, torch.float8_e4m3fn, dense_block)
    else:
        raise ValueError(f"quantization_config.expert_dtype {expert_dtype!r} is not supported (known: fp4, fp8)")
    return {DENSE: dense, EXPERT: expert, ENGRAM: Layout(ENGRAM, torch.float8_e4m3fn, (1, MX_BLOCK))}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_layout(name: str, layout: Layout, weight: torch.Tensor | tuple[int, ...] | None,
                 scale_shape: tuple[int, ...], logical_shape: tuple[int, ...]) -> None:
    """Refuse, naming `name`, a weight of another storage dtype than the role's or a scale grid that is not the
    role's block. The block is derived from the shapes per tensor (element counts, packing undone) and compared
    with the role's, so an NVFP4-style per-16 scale or a per-32-bytes one is an error, not a silent misread."""
    if isinstance(weight, torch.Tensor) and weight.dtype != layout.storage_dtype:
        raise ValueError(f"{name}: {weight.dtype} where the checkpoint's {layout.role} weights are {layout.format} "
                         f"({layout.storage_dtype})")
    *lead, n, k = logical_shape
    bn, bk = layout.element_block
    want = (*lead, _cdiv(n, bn), _cdiv(k, bk))
    if tuple(scale_shape) == want:
        return
    detail = ""
    if len(scale_shape) == len(logical_shape) and scale_shape[-1] > 0 and scale_shape[-2] > 0:
        derived = (n // scale_shape[-2], k // scale_shape[-1])
        stored = (n // scale_shape[-2], k // layout.pack // scale_shape[-1])
        detail = f": the scale grid derives {derived[0]}x{derived[1]}-element blocks"
        if layout.pack > 1:
            detail += (f" ({stored[0]}x{stored[1]} on disk, where {layout.pack} elements share a byte; this role "
                       f"wants {bk} elements = {layout.stored_block[1]} bytes per scale)")
    raise ValueError(f"{name}: scale shape {tuple(scale_shape)} != {want}, the {bn}x{bk} blocks of the "
                     f"{layout.role} role for a {'x'.join(map(str, logical_shape))} weight{detail}")


# ---- e8m0 scales ----

def decode_e8m0(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """An e8m0 scale tensor (float8_e8m0fnu, raw uint8 bytes, or float32/bf16 powers of two) -> float32."""
    if scale.dtype == torch.uint8:
        if (scale == _E8M0_NAN).any():
            raise ValueError(f"{name}: e8m0 byte 255 (NaN) in a scale")
        return torch.ldexp(torch.ones_like(scale, dtype=torch.float32), scale.to(torch.int32) - 127)
    if scale.dtype == torch.float8_e8m0fnu:
        return decode_e8m0(scale.view(torch.uint8), name)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
        s = scale.float()
        mantissa, _ = torch.frexp(s)
        if not ((mantissa == 0.5) & (s > 0)).all():
            raise ValueError(f"{name}: {scale.dtype} scale that is not a positive power of two where the "
                             "checkpoint says scale_fmt 'ue8m0'")
        return s
    raise ValueError(f"{name}: scale dtype {scale.dtype} is not an e8m0 scale (float8_e8m0fnu, uint8 or float32)")


def e8m0_scale_for(amax: torch.Tensor, value_max: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= value_max (so no value clips), as float32, clamped to e8m0's
    range; amax 0 gives the smallest scale."""
    exp = torch.ceil(torch.log2(amax.float() / value_max)).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(exp), exp.to(torch.int32))


def encode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two -> float8_e8m0fnu (exact)."""
    decode_e8m0(scale, "scale")  # refuses anything that is not a power of two
    _, exp = torch.frexp(scale.float())
    return (exp - 1 + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


# ---- FP8 e4m3 with e8m0 block scales (DENSE, ENGRAM) ----

def quantize_fp8_e8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K) -> (float8_e4m3fn (..., N, K), float8_e8m0fnu (..., ceil(N/bn), ceil(K/bk))): each block
    divided by the power of two just above its amax / 448; edge blocks cover what is left of N and K."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = w.new_zeros(*lead, nb * bn, kb * bk, dtype=torch.float32)
    padded[..., :n, :k] = w
    tiles = padded.view(*lead, nb, bn, kb, bk)
    scale = e8m0_scale_for(tiles.abs().amax(dim=(-3, -1)), FP8_E4M3_MAX)  # (..., nb, kb)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), encode_e8m0(scale)


def dequantize_fp8_e8m0(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_fp8_blocks(q, decode_e8m0(scale), block, dtype)


# ---- MXFP4 (EXPERT) ----

def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 (..., K/2), two e2m1 codes per byte (element 2j low nibble) -> float32 values (..., K)."""
    u8 = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).long()
    return table[codes].flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 (..., K), K even -> int8 (..., K/2)."""
    c = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (c[..., 0] | (c[..., 1] << 4)).view(torch.int8)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each value of x (|x| <= 6 after scaling; a tie goes to the smaller magnitude)."""
    mag = torch.bucketize(x.abs().float(), torch.tensor(_E2M1_MIDPOINTS, device=x.device))
    return mag + 8 * (x < 0).to(mag.dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K), K a multiple of 32 -> (int8 (..., N, K/2), float8_e8m0fnu (..., N, K/32))."""
    k = w.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs K a multiple of {MX_BLOCK}, got a {tuple(w.shape)} weight")
    groups = w.float().unflatten(-1, (k // MX_BLOCK, MX_BLOCK))
    scale = e8m0_scale_for(groups.abs().amax(dim=-1), E2M1_MAX)
    codes = e2m1_codes(groups / scale[..., None]).flatten(-2)
    return pack_e2m1(codes), encode_e8m0(scale)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> torch.Tensor:
    """int8 (..., N, K/2) with e8m0 (..., N, K/32) -> (..., N, K) `dtype` (value x 2^e exact in fp32)."""
    values = unpack_e2m1(packed)
    s = decode_e8m0(scale, name + " scale")
    if s.shape[-1] * MX_BLOCK != values.shape[-1] or s.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"{name}: scale shape {tuple(s.shape)} is not one per {MX_BLOCK} elements of the "
                         f"{tuple(values.shape)} unpacked weight")
    return (values * s.repeat_interleave(MX_BLOCK, dim=-1)).to(dtype)


# ---- Engram tables (V4.1) ----

def quantize_engram_table(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, D), D a multiple of 32 -> (float8_e4m3fn (rows, D), float8_e8m0fnu (rows, D/32))."""
    if table.shape[-1] % MX_BLOCK:
        raise ValueError(f"Engram tables need a width that is a multiple of {MX_BLOCK}, got {tuple(table.shape)}")
    return quantize_fp8_e8m0(table, (1, MX_BLOCK))


def engram_lookup(table: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized rows `rows` (any shape of row ids) of an FP8 Engram table with per-32-column e8m0
    scales -> (*rows.shape, D): only the fetched rows are decoded (the tables are host-memory sized)."""
    n, d = table.shape
    check_layout("engram table", role_layouts((1, MX_BLOCK), "fp8")[ENGRAM], table, tuple(scale.shape), (n, d))
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise ValueError(f"engram row ids must lie in [0, {n}), got [{int(rows.min())}, {int(rows.max())}]")
    flat = rows.reshape(-1).to(table.device)
    values = table[flat].float() * decode_e8m0(scale[flat]).repeat_interleave(MX_BLOCK, dim=-1)
    return values.to(dtype).view(*rows.shape, d)


def dequantize_by_layout(layout: Layout, weight: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """A release tensor of `layout` (weight + e8m0 scale) -> `dtype`, after check_layout."""
    logical = (*weight.shape[:-1], weight.shape[-1] * layout.pack)
    check_layout(name, layout, weight, tuple(scale.shape), logical)
    if layout.pack == 2:
        return dequantize_mxfp4(weight, scale, dtype, name)
    s = decode_e8m0(scale, name + " scale")
    return (weight.float() * expand_block_scales(s, tuple(weight.shape[-2:]), layout.element_block)).to(dtype)


def quantize_by_layout(layout: Layout, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse writer: a 16/32-bit weight in `layout` (weight, e8m0 scale)."""
    if layout.pack == 2:
        return quantize_mxfp4(w)
    return quantize_fp8_e8m0(w, layout.element_block)


def read_scale(loaded: torch.Tensor, scale_fmt: str, name: str = "scale") -> torch.Tensor:
    """A checkpoint scale as float32: e8m0 decoded under scale_fmt 'ue8m0'; under 'float32' a float tensor as
    it is, and raw bytes refused (they would be read as numbers)."""
    if scale_fmt == "ue8m0":
        return decode_e8m0(loaded, name)
    if loaded.dtype == torch.float8_e8m0fnu:
        return decode_e8m0(loaded, name)
    if not loaded.is_floating_point() or loaded.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{name}: {loaded.dtype} scale where the checkpoint's scale_fmt is float32 (e8m0 bytes "
                         "need quantization_config.scale_fmt 'ue8m0')")
    return loaded.float()
