"""MLA prefill chunks in the standard ("MHA") form; decode rows keep the absorbed form.

The absorbed form (layers/mla.py) attends with head dims 576 (q.k) and 512 (p.V) over one shared latent head:
cheap per cached token, which suits decode, but 3.4x the FLOPs of the model's own dims (192 and 128), and
flash attention takes no head dim above 256, so SDPA falls back to its memory-efficient kernel. For a prefill
chunk of n new tokens over L KV positions the standard form instead expands each position's latent once
through kv_b_proj into per-head K_nope and V and attends with the native dims:

    k = [W_UK c | k_pe] (L, H, nope + rope)    v = W_UV c (L, H, v)    q = [q_nope | q_pe] (n, H, nope + rope)

Expansion costs 2 L C H (nope + v) FLOPs against the absorbed form's extra 2 n L H (2C - nope - v), so it
pays once n reaches C (nope + v) / (2C - nope - v) ~ 170 new tokens (C = 512) if both ran at one rate; the
expansion is a plain GEMM and flash beats the memory-efficient kernel per FLOP, so the break-even is lower, and
MHA_MIN_QUERIES assumes a ~2.5x rate advantage (not measured per chunk size). Shorter chunks (speculative
verification, small tails of chunked prefill over a long prefix) stay absorbed.

The latents are read back from the pool after the new tokens are stored, so a chunk over a cached prefix
(prefix-cache hit, chunked prefill) sees its whole context.
"""
from __future__ import annotations

import functools
import logging

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
import torch.nn.functional as F

from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.torch_ref import causal_mask
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.sampler import to_device

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias  # imports torch._dynamo: seconds of every process start
    from deepinfer_rt.layers.attention.base import AttentionBackend

logger = logging.getLogger("deepinfer_rt")

MHA_MIN_QUERIES = 64
"""Fewest new tokens of a chunk run in the standard form by default (see the module docstring)."""


@dataclass
class Segment:
    q_start: int
    q_len: int
    slots: torch.Tensor
    """(kv_len,) pool slots of all the sequence's KV positions, cached prefix first."""
    mask: torch.Tensor | CausalBias | None
    """None: no cached prefix (plain causal); else causal aligned to the last KV position."""


@dataclass
class MLAPrefillPlan:
    segments: list[Segment]
    """Sequences attended in the standard form; empty when the whole batch is absorbed."""
    absorbed_rows: torch.Tensor | None = None
    """Token rows of the other sequences (None when there are none)."""
    absorbed: ForwardBatch | None = None
    """Those sequences as a batch of their own, prepared by the backend."""


def min_mha_queries(config: KernelConfig, backend: AttentionBackend) -> int | None:
    """Fewest new tokens of a chunk taken in the standard form, or None for none (KernelConfig.mla_mha_prefill).
    Batch-invariant mode keeps the absorbed form: its attention splits are fixed for any batch."""
    mode = config.mla_mha_prefill
    if config.is_batch_invariant or mode is False:
        return None
    if mode:
        return 2
    return MHA_MIN_QUERIES if backend.is_mla_standard_prefill_preferred else None


def plan_for(batch: ForwardBatch, config: KernelConfig) -> MLAPrefillPlan:
    """The batch's plan for every MLA layer (the model's prepare_batch keeps it as batch.mla_plan)."""
    return build_plan(batch, min_mha_queries(config, batch.backend))


def build_plan(batch: ForwardBatch, min_queries: int | None) -> MLAPrefillPlan:
    """Chunks of at least `min_queries` new tokens go to the standard form. Pure Python for an all-absorbed
    batch (decode steps, CUDA-graph capture): it creates no tensors then."""
    if min_queries is None or max(batch.q_lens, default=0) < min_queries:
        return MLAPrefillPlan([])
    dev = batch.input_ids.device
    segments, rows, keep = [], [], []
    start = 0
    for i, (q_len, kv_len, slots) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.kv_slots)):
        if q_len >= min_queries:
            segments.append(Segment(start, q_len, slots, _causal(q_len, kv_len, dev)))
        else:
            rows.extend(range(start, start + q_len))
            keep.append(i)
        start += q_len
    if not rows:
        return MLAPrefillPlan(segments)
    absorbed_rows = to_device(rows, torch.long, dev)
    absorbed = ForwardBatch(
        input_ids=batch.input_ids[absorbed_rows], positions=batch.positions[absorbed_rows],
        out_slots=batch.out_slots[absorbed_rows], q_lens=[batch.q_lens[i] for i in keep],
        kv_lens=[batch.kv_lens[i] for i in keep], kv_slots=[batch.kv_slots[i] for i in keep], pool=batch.pool,
        backend=batch.backend, mla_plan=MLAPrefillPlan([]))
    batch.backend.prepare(absorbed)
    return MLAPrefillPlan(segments, absorbed_rows, absorbed)


def _causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | CausalBias | None:
    if q_len == kv_len:
        return None
    # CUDA: the lower-right causal bias runs in the flash / memory-efficient kernels; elsewhere it would only
    # be materialised (with a warning per call), so build the boolean mask once here.
    if device.type != "cuda":
        return causal_mask(q_len, kv_len, device)
    from torch.nn.attention.bias import causal_lower_right  # imported here: it brings torch._dynamo (seconds)

    return causal_lower_right(q_len, kv_len)


def prefill_attention(layer: nn.Module, plan: MLAPrefillPlan, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q (T, H, nope + rope), rotated -> attention output (T, H, v) of every row, before o_proj; the new tokens'
    KV is already in the pool."""
    out = q.new_empty(q.shape[0], layer.num_heads, layer.v_dim)
    for seg in plan.segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        kv_rows = batch.pool.rows(layer.layer_id, seg.slots)[0]  # dequantized from an fp8_e4m3 pool
        out[rows] = standard_attention(layer, q[rows], kv_rows[:, 0], seg.mask)
    if plan.absorbed is not None:
        rows = plan.absorbed_rows
        out[rows] = layer.absorbed_attention(q[rows], plan.absorbed)
    return out


def standard_attention(layer: nn.Module, q: torch.Tensor, kv_rows: torch.Tensor,
                       mask: torch.Tensor | CausalBias | None) -> torch.Tensor:
    """One sequence: q (n, H, nope + rope), kv_rows (L, C + rope) pool rows [c | k_pe] of all its KV positions
    -> (n, H, v)."""
    num_kv, heads, qk_dim = kv_rows.shape[0], layer.num_heads, q.shape[-1]
    latent, k_pe = kv_rows.split([layer.kv_lora_rank, layer.rope_dim], dim=-1)
    # cuDNN's calls take V at its own width: no padded GEMM, no padded p.V (the split, and an aligned first chunk).
    is_cudnn = is_cudnn_chunk(layer.prefix_split, q, num_kv - q.shape[0])
    if layer.is_padded_prefill and not is_cudnn:
        # Flash attention takes one head dim for q, k and v. kv_b_proj's rows padded per head (`padded_kv_b`)
        # make one GEMM write K's nope part and V, each already qk_dim wide: only k_pe is copied in.
        kv = F.linear(latent, layer.padded_kv_b()).view(num_kv, heads, 2, qk_dim)
        k, v = kv.unbind(2)
        k[..., layer.nope_dim:] = k_pe[:, None]
    else:
        k_nope, v = layer.kv_b_proj(latent).view(num_kv, heads, -1).split([layer.nope_dim, layer.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(num_kv, heads, layer.rope_dim)], dim=-1)  # (L, H, qk_dim)
    # 4-D (1, H, len, dim): the fused kernels take only batched inputs.
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    o = cudnn_attention(q4, k4, v4, layer.scale) if is_cudnn else None
    if o is None:
        if is_cudnn and layer.is_padded_prefill:  # after a refusal: flash takes one head width
            v4 = F.pad(v4, (0, qk_dim - v4.shape[-1]))
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=layer.scale)
    return o[0, ..., : layer.v_dim].transpose(0, 1)


PREFIX_SPLIT_ALIGN = 1024
"""By default the split takes only chunks whose new tokens and cached prefix are both multiples of this: the
chunks of a long prompt's chunked prefill. cuDNN builds an execution plan for each new shape (costly, not yet
measured here); aligned shapes recur across layers and requests, while a prompt's tail chunk or a prefix-cache hit
of any length would each build new ones. Other chunks keep the one masked flash call."""

MIN_CUDNN_VERSION = 90300
"""cuDNN 9.3 or newer for the default split: public reports tie wrong log-sum-exps for large scores to older
builds, and the merge reads them."""

_prefix_split_refused: str | None = None
"""Why cuDNN refused a split call in this process (then every chunk takes the masked call)."""


_v_width_refused = False
"""Whether cuDNN refused V narrower than q.k in this process (then cuDNN's calls take V padded to q.k's width)."""


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """prefix_split_attention, V at its own width; where cuDNN refuses that, once more with V padded to q.k's width
    (and padded from then on); None when it refuses that too (a build or device that refuses the call: the masked
    SDPA call from then on). The output may carry padded columns past V's width."""
    global _v_width_refused
    dv, dqk = v.shape[-1], q.shape[-1]
    forms = (True,) if dv < dqk and _v_width_refused else (False, True) if dv < dqk else (False,)
    for padded in forms:
        try:
            return prefix_split_attention(q, k, F.pad(v, (0, dqk - dv)) if padded else v, scale)
        except RuntimeError as err:
            refusal = err
            if not padded and dv < dqk:
                _v_width_refused = True
                logger.warning("MLA prefill: cuDNN refused V of %d columns beside q.k of %d (%s); V is padded for "
                               "its calls from now on", dv, dqk, str(err).splitlines()[0] if str(err) else "")
    _refuse_prefix_split(refusal)
    return None


def _refuse_prefix_split(err: RuntimeError) -> None:
    global _prefix_split_refused
    if _prefix_split_refused is None:
        _prefix_split_refused = str(err).splitlines()[0] if str(err) else type(err).__name__
        logger.warning("MLA prefill: the two-call prefix split failed (%s); chunks over a prefix take one masked "
                       "SDPA call from now on", _prefix_split_refused)


def is_prefix_split(mode: bool | None, q: torch.Tensor, prefix: int) -> bool:
    """Whether a chunk of q.shape[0] new tokens over `prefix` cached ones takes prefix_split_attention
    (KernelConfig.mla_prefix_split). None: on CUDA for 16-bit q on Hopper or newer with cuDNN >= 9.3 (its fast
    kernels), for chunks aligned to PREFIX_SPLIT_ALIGN, unless cuDNN refused it before; True: every chunk over a
    prefix."""
    return prefix > 0 and is_cudnn_chunk(mode, q, prefix)


def is_cudnn_chunk(mode: bool | None, q: torch.Tensor, prefix: int) -> bool:
    """is_prefix_split, and by default (mode None) also an aligned chunk with no prefix (then one causal call through
    attention_with_lse): the chunks whose V keeps its own width."""
    if mode is False:
        return False
    if mode:
        return prefix > 0
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _prefix_split_refused is None
            and q.shape[0] % PREFIX_SPLIT_ALIGN == 0 and prefix % PREFIX_SPLIT_ALIGN == 0
            and _is_cudnn_split_device(q.device.index))


@functools.cache
def _is_cudnn_split_device(index: int | None) -> bool:
    """Hopper or newer with cuDNN >= MIN_CUDNN_VERSION (asked once per device, not per layer call)."""
    return (torch.cuda.get_device_capability(index)[0] >= 9
            and (torch.backends.cudnn.version() or 0) >= MIN_CUDNN_VERSION)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA of (1, H, n, d) q over (1, H, L, d) k / (1, H, L, dv) v, causal from the top left when is_causal,
    with the rows' natural log-sum-exps of the scaled scores: (out (1, H, n, dv), lse (1, H, n) fp32). CUDA:
    cuDNN's kernel (16-bit); CPU: torch's flash kernel for CPU."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False,
                                                                       scale=scale)[:2]
    else:  # this kernel takes one head size: V is padded to q's (tests; MLA's v is never wider than q.k)
        dv = v.shape[-1]
        v = F.pad(v, (0, q.shape[-1] - dv)) if dv < q.shape[-1] else v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                              scale=scale)[:2]
        out = out[..., :dv]
    return out, lse.reshape(q.shape[:3])


def prefix_split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention aligned to the last key (a chunk of n queries over L > n keys, the first L - n a cached
    prefix) as two maskless kernels: every query over the prefix keys, and the chunk over its own n keys causal
    from the top left; the two partial outputs are weighted by exp(lse_part - lse_all). Torch routes a
    bottom-right causal mask only to its flash / memory-efficient kernels; cuDNN's (faster on Hopper) takes no
    such mask but runs both parts. (1, H, n, d), (1, H, L, d), (1, H, L, dv) -> (1, H, n, dv) in q's dtype."""
    prefix = k.shape[2] - q.shape[2]
    if prefix <= 0:
        return attention_with_lse(q, k, v, True, scale)[0].to(q.dtype)
    o_pre, lse_pre = attention_with_lse(q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
    o_own, lse_own = attention_with_lse(q, k[:, :, prefix:], v[:, :, prefix:], True, scale)
    lse = torch.logaddexp(lse_pre, lse_own)
    w_pre, w_own = torch.exp(lse_pre - lse)[..., None], torch.exp(lse_own - lse)[..., None]
    return (o_pre.float() * w_pre + o_own.float() * w_own).to(q.dtype)
