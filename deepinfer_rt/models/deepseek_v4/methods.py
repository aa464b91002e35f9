"""DeepSeek-V4's layer methods: the model's own numerics, default or batch-invariant, chosen once from the
KernelConfig when a layer is built (`self.method = v4_method(current_kernel_config())`).

V4Method holds the default forms (the CPU path and the reference); V4TritonMethod (CUDA)
runs attention, the indexer, the compressor's pooling, the norms, the rotation and the hyper-connections through
Triton kernels; V4InvariantMethod replaces
each by its batch-invariant form (models/deepseek_v4/invariant.py): fixed-shape GEMMs, exp-built
sigmoid/silu/softplus, sums over a middle dim as ordered adds, per-query key lists in attention and the indexer,
one-row-safe row reductions. V4InvariantTritonMethod (CUDA, batch-invariant) is V4InvariantMethod with attention
and the indexer scores in the kernels' batch-invariant modes (fixed splits, fixed order).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
import torch.nn.functional as F

from deepinfer_kernels.reference import stable_topk, topk_of_keys
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.methods import (Activation, HeadMatmul, InvariantLinear, LinearMethod, activation_method,
                                         head_matmul_method, linear_method)
from deepinfer_rt.models.deepseek_v4 import invariant as v4_invariant

if TYPE_CHECKING:
    from deepinfer_rt.models.deepseek_v4.batch import AttnGroup, Windows
    # LayerKV and Fp8Rows (models/deepseek_v4/common.py) are named, not imported: common imports this module.


def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, ..., D) rotated on its trailing 2 * cos.shape[-1] channels; cos/sin (N, R/2) broadcast over the
    middle dims. Pass -sin to undo a rotation."""
    extra = (1,) * (x.dim() - 2)
    cos = cos.repeat_interleave(2, dim=-1).view(cos.shape[0], *extra, -1)
    sin = sin.repeat_interleave(2, dim=-1).view(sin.shape[0], *extra, -1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope * cos + rotated * sin).to(x.dtype)], dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fp32 gain times the fp32 normalised input, one cast back (V4RMSNorm)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class V4Method:
    """The default forms."""

    pdl = False
    """Whether the Triton kernels launch as programmatic dependent launches (V4TritonMethod sets it)."""

    def __init__(self, linear: LinearMethod, activation: Activation, head_matmul: HeadMatmul):
        self.linear = linear
        """Products of raw tensors (router, experts); V4's Linear layers hold their own linear method."""
        self.activation = activation
        self.head_matmul = head_matmul

    # ---- elementwise and reductions ----

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn, a reduction over the last dim row by row, on x."""
        return fn(x)

    def unweighted_rms_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self.rows(lambda r: _unweighted_rms_norm(r, eps), x)

    def float_rms_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """unweighted_rms_norm of x.float() (the hyper-connections' flattened streams)."""
        return self.unweighted_rms_norm(x.float(), eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.rows(lambda r: _rms_norm(r, weight, eps), x)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (N, ..., D) rotated on its trailing channels (apply_rope); -sin undoes a rotation."""
        return apply_rope(x, cos, sin)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rope of an x not needed unrotated: rotated in place by V4TritonMethod; use the returned tensor."""
        return self.rope(x, cos, sin)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation.sigmoid(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """The experts' activation: silu(gate clamped above at limit) * (up clamped to +-limit)."""
        return self.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    def score(self, logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
        """Router scores of the logits (T, E)."""
        if scoring_func == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if scoring_func == "sigmoid":
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def route(self, router: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A V4Router's choice for x (T, H): (weights (T, k) fp32, expert ids (T, k)). The scores of the fp32
        logits; the experts are the token's row of the hash table, or the top k of scores + correction bias; their
        scores normalized over the k and scaled."""
        scores = self.score(self.linear.linear(x.float(), router.weight.float()), router.scoring_func)
        if router.tid2eid is not None:
            ids = router.tid2eid[input_ids]
        else:
            ids = (scores + router.bias.float()).topk(router.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * router.scaling, ids

    def middle_sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x.sum(dim) over a middle dim (MoE slots, hyper-connection streams)."""
        return x.sum(dim=dim)

    def column_sum(self, comb: torch.Tensor) -> torch.Tensor:
        """comb (T, N, N) summed over dim -2, kept: (T, 1, N) (the Sinkhorn column normalisation)."""
        return comb.sum(dim=-2, keepdim=True)

    def sinkhorn(self, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """The mHC residual mix (T, N, N) from its logits: softmax over the last dim + eps, then Sinkhorn-Knopp
        (column sums, then iters - 1 rounds of row and column sums, each + eps)."""
        comb = torch.softmax(logits, dim=-1) + eps
        comb = comb / (self.column_sum(comb) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (self.column_sum(comb) + eps)
        return comb

    # ---- hyper-connections (models/deepseek_v4/hyper_connections.py) ----

    def hc_weights(self, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The perceptron's logits mix (T, (2 + n) n) fp32 -> pre (T, n), post (T, n), comb (T, n, n), fp32."""
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = scale.float().unbind(0)
        pre = self.sigmoid(pre_w * pre_s + pre_b) + eps
        post = 2 * self.sigmoid(post_w * post_s + post_b)
        comb = self.sinkhorn(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), iters, eps)
        return pre, post, comb

    def hc_collapse(self, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """pre (T, N) fp32, streams (T, N, D) -> the block input sum_j pre_j streams_j (T, D), streams' dtype."""
        return self.middle_sum(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)

    def hc_expand(self, post: torch.Tensor, y: torch.Tensor, comb: torch.Tensor,
                  streams: torch.Tensor) -> torch.Tensor:
        """The new streams: post_k y + sum_j comb_jk streams_j (T, N, D), streams' dtype."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + self.hc_mix(comb.to(dtype), streams)

    # ---- products ----

    def hc_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (T, K) @ w.T, w (N, K) (hyper-connection weights)."""
        return x @ w.T

    def hc_logits(self, flat: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """The hyper-connections' mix logits: float_rms_norm(flat) @ w.float().T, flat (T, N D), w (M, N D) -> (T, M)
        fp32."""
        return self.hc_matmul(self.float_rms_norm(flat, eps), w.float())

    def hc_mix(self, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tjk,tjd->tkd", comb, streams)

    def grouped_projection(self, grouped: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """grouped (T, g, i) by w (g, r, i) per group -> (T, g, r) (attention's wo_a)."""
        return torch.einsum("tgi,gri->tgr", grouped, w)

    def pool_window(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """kv (N, m, C), gate (N, m, C) fp32 -> softmax over the window of gate, weighted sum of kv (N, C)."""
        return (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)

    def window_pool(self, buf: torch.Tensor, kv_cols: slice, gate_cols: slice, win: Windows,
                    ape: torch.Tensor | None, d: int, overlap: bool, fp32: bool = False) -> torch.Tensor:
        """The windows' pooled entries (N, d), from the compressor inputs kept in buf's kv and gate columns (models/
        deepseek_v4/compressor.py): the window's tokens, and with `overlap` (CSA) the first half of the previous
        window's (gates -inf for window 0) beside the second half of its own; pool_window of gate + ape (None: no
        bias). `fp32`: the kv rows converted to fp32 first, an fp32 result (V4.1's compressor)."""
        kv_buf, gate_buf = buf[:, kv_cols], buf[:, gate_cols]
        kv, gate = kv_buf[win.cur], gate_buf[win.cur].float()  # (N, m, width)
        kv = kv.float() if fp32 else kv
        gate = gate if ape is None else gate + ape.float()
        if overlap:
            prev_gate = gate_buf[:, :d][win.prev].float()
            prev_gate = prev_gate if ape is None else prev_gate + ape[:, :d].float()
            prev_gate = prev_gate.masked_fill(~win.has_prev[:, None, None], float("-inf"))
            prev_kv = kv_buf[:, :d][win.prev]
            kv = torch.cat([prev_kv.float() if fp32 else prev_kv, kv[..., d:]], dim=1)  # (N, 2m, d)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        return self.pool_window(kv, gate)

    # ---- attention and indexer ----

    def attend(self, layer: nn.Module, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
               positions: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """Attention of one group's queries -> (G*Q, H, D), over the group's padded key set (sliding keys at
        kv.recent[swa_slots], entries at kv.entries[entry_slots])."""
        # Column views first, so the gathers read only the columns used, not whole pool rows.
        keys, mask = kv.swa(g.swa_slots), g.swa_mask  # (G, L, D), (G, Q, L)
        if layer.ratio:
            slots, visible = g.entry_slots[layer.ratio], g.entry_mask[layer.ratio]  # (G, E), (G, Q, E)
            if layer.indexer is not None:
                visible = layer.indexer.select(g.take(x), g.take(q_residual), g.take(positions),
                                               kv.idx_entry(slots), visible)
            keys = torch.cat([keys, kv.entry(slots)], dim=1)
            mask = torch.cat([mask, visible], dim=2)
        qg = g.take(q).view(g.num_seqs, g.q_len, layer.num_heads, layer.head_dim)
        scores = torch.einsum("gqhd,gld->gqhl", qg, keys) * layer.head_dim ** -0.5
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        sink = layer.attn_sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        out = torch.einsum("gqhl,gld->gqhd", probs.to(keys.dtype), keys)
        return out.reshape(-1, layer.num_heads, layer.head_dim)

    def index_select(self, indexer: nn.Module, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
        """q (G*Q, H, Di) rotated, keys (G, E, Di), weights (G*Q, H), visible (G, Q, E) -> (G, Q, E) True for the
        top index_topk visible entries by sum_h w_h * relu(q_h . k)."""
        g, q_len, _ = visible.shape
        q = q.view(g, q_len, indexer.num_heads, indexer.head_dim)
        scores = torch.einsum("gqhd,ged->gqhe", q.float(), keys.float()).relu() * indexer.head_dim ** -0.5
        weights = weights.view(g, q_len, indexer.num_heads, 1)
        scores = (scores * weights).sum(dim=2).masked_fill(~visible, float("-inf"))  # (G, Q, E)
        picks = stable_topk(scores, indexer.topk)[1]  # ties to the earlier entry, as every method
        chosen = torch.zeros_like(visible).scatter_(-1, picks, True)
        return chosen & visible  # picks beyond the visible entries (too few of them) are dropped


class V4InvariantMethod(V4Method):
    """The batch-invariant forms (models/deepseek_v4/invariant.py)."""

    linear: InvariantLinear

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return v4_invariant.one_row_safe(fn, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return v4_invariant.silu(x)

    def score(self, logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
        if scoring_func == "sqrtsoftplus":
            return v4_invariant.softplus(logits).sqrt()
        if scoring_func == "sigmoid":
            return self.sigmoid(logits)
        return logits.softmax(dim=-1)

    def middle_sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return v4_invariant.ordered_sum(x, dim=dim)

    def column_sum(self, comb: torch.Tensor) -> torch.Tensor:
        return v4_invariant.ordered_sum(comb, dim=-2)[:, None]

    def hc_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.linear.mm(x, w.t())

    def hc_mix(self, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return v4_invariant.hc_mix(comb, streams)

    def grouped_projection(self, grouped: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.head_matmul.apply(grouped, w.transpose(1, 2))

    def pool_window(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return v4_invariant.pool_window(kv, gate)

    def attend(self, layer: nn.Module, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
               positions: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """Each query's keys in its own fixed blocks (v4_invariant.key_lists / attend)."""
        entry_slots = entry_mask = None
        if layer.ratio:
            entry_slots, entry_mask = g.entry_slots[layer.ratio], g.entry_mask[layer.ratio]
            if layer.indexer is not None:
                entry_mask = layer.indexer.select(g.take(x), g.take(q_residual), g.take(positions),
                                                  kv.idx_entry(entry_slots), entry_mask)
        slots, valid, is_entry = v4_invariant.key_lists(g.swa_slots, g.swa_mask, entry_slots, entry_mask)
        # One list mixes sliding-key slots and entry rows (is_entry says which): clamp each gather to its buffer.
        keys = kv.swa(slots.clamp(max=kv.num_recent_rows - 1))
        if entry_slots is not None:
            entry_keys = kv.entry(slots.clamp(max=kv.num_entry_rows - 1))
            keys = torch.where(is_entry[..., None], entry_keys, keys)
        return v4_invariant.attend(g.take(q), keys.to(q.dtype), valid, layer.head_dim ** -0.5, layer.attn_sink)

    def index_select(self, indexer: nn.Module, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
        """Per query (v4_invariant.index_scores / top_k_mask)."""
        g, q_len, num_entries = visible.shape
        per_query = keys.float()[:, None].expand(g, q_len, *keys.shape[1:]).reshape(g * q_len, *keys.shape[1:])
        scores = v4_invariant.index_scores(q.float(), per_query, weights, indexer.head_dim ** -0.5)
        return v4_invariant.top_k_mask(scores, visible.reshape(g * q_len, -1), indexer.topk).view(g, q_len, -1)


class V4TritonMethod(V4Method):
    """CUDA, not batch-invariant: attention, the indexer, the compressor's pooling, the RMSNorms, the rotation, and
    the hyper-connections' logits, mixes (with the Sinkhorn projection), collapse and spread through
    deepinfer_kernels (v4_attention, v4_indexer, v4_pooling, v4_elementwise, v4_hyper); every other form is
    V4Method's.

    Attention reads the keys where the pool keeps them: the sliding-window keys and the compressed entries are two
    key sources (buffer, rows, mask) of one sparse MQA kernel, so no (G, L, D) copy of the keys is made and the
    softmax runs in fp32. With kv_cache_dtype='fp8_e4m3' the sources (and the indexer's keys) are the pool's
    float8 rows with their row scales, read as they are stored. For CSA the indexer's choice travels as entry
    indices, (G, Q, topk) with -1 for none, instead of V4Method's (G, Q, E) mask: the kernel then reads topk
    entries per query, not all E. The top-k is stable_topk, V4Method's rule (ties to the earlier entry).

    pdl: every kernel here a programmatic dependent launch (KernelConfig.uses_pdl; each waits first thing)."""

    def __init__(self, linear: LinearMethod, activation: Activation, head_matmul: HeadMatmul, pdl: bool = False):
        super().__init__(linear, activation, head_matmul)
        self.kernels = v4_kernels()
        self.pdl = pdl

    def sinkhorn(self, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return self.kernels.sinkhorn.sinkhorn(logits, iters, eps, pdl=self.pdl)

    def unweighted_rms_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.elementwise.rms_norm(x, None, eps, pdl=self.pdl)

    def hc_logits(self, flat: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # one pass over the streams: no fp32 copy of them, no fp32 GEMM of a few columns
        return self.kernels.hyper.hc_logits(flat, w, eps, pdl=self.pdl)

    def hc_weights(self, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.hyper.hc_weights(mix, base, scale, iters, eps, pdl=self.pdl)

    def hc_collapse(self, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return self.kernels.hyper.hc_collapse(pre, streams, pdl=self.pdl)

    def hc_expand(self, post: torch.Tensor, y: torch.Tensor, comb: torch.Tensor,
                  streams: torch.Tensor) -> torch.Tensor:
        return self.kernels.hyper.hc_expand(post, y, comb, streams, pdl=self.pdl)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.elementwise.rms_norm(x, weight, eps, pdl=self.pdl)

    def route(self, router: nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scoring, the choice (hash table or top k, ties to the lower id, ids ascending) and the weights in one
        launch after the logits (deepinfer_kernels.moe_router), where V4Method's forms take about nine."""
        kernels = self.kernels.router
        if router.scoring_func not in kernels.SCORINGS:
            return super().route(router, x, input_ids)
        logits = self.linear.linear(x.float(), router.weight.float())
        if router.tid2eid is not None:
            return kernels.route_hashed(logits, input_ids, router.tid2eid, scoring_func=router.scoring_func,
                                norm_topk_prob=True, routed_scaling_factor=router.scaling)
        return kernels.route(logits, router.top_k, scoring_func=router.scoring_func, topk_method="noaux_tc", n_group=1,
                     topk_group=1, correction_bias=router.bias.float(), norm_topk_prob=True,
                     routed_scaling_factor=router.scaling, pdl=self.pdl)

    def clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.dtype != up.dtype:
            return super().clamped_swiglu(gate, up, limit)
        return self.kernels.elementwise.clamped_swiglu(gate, up, limit, pdl=self.pdl)  # one launch for four

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        half = cos.shape[-1]
        if half & (half - 1) or not x.numel():  # the kernel's pairs are a power of two (V4's 64-channel rope is)
            return super().rope(x, cos, sin)
        return self.kernels.elementwise.rope(x, cos, sin, pdl=self.pdl, inplace=inplace)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.rope(x, cos, sin, inplace=True)

    def pool_window(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.kernels.pooling.pool_window(kv, gate, pdl=self.pdl)

    def window_pool(self, buf: torch.Tensor, kv_cols: slice, gate_cols: slice, win: Windows,
                    ape: torch.Tensor | None, d: int, overlap: bool, fp32: bool = False) -> torch.Tensor:
        """The gathers, the position bias and the pooling in one launch, where the torch form takes about twelve."""
        return self.kernels.pooling.pool_gathered(buf, kv_cols.start, gate_cols.start, win.cur, win.prev,
                                                  win.has_prev, ape, d, overlap,
                                                  out_dtype=torch.float32 if fp32 else None, pdl=self.pdl)

    def _keys(self, fp8: Fp8Rows | None, plain: torch.Tensor, rows: torch.Tensor,
              mask: torch.Tensor | None = None):
        return key_source(self.kernels, fp8, plain, rows, mask)

    def attend(self, layer: nn.Module, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
               positions: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        cols = kv.cols
        sources = [self._keys(kv.fp8_swa, kv.recent[:, cols.swa], g.swa_slots, g.swa_mask)]
        if layer.ratio:
            slots, visible = g.entry_slots[layer.ratio], g.entry_mask[layer.ratio]  # (G, E), (G, Q, E)
            entries = kv.entries[:, cols.entry]
            if layer.indexer is not None:
                index_keys = self._keys(kv.fp8_idx_entry, kv.entries[:, cols.idx_entry], slots)
                picks = layer.indexer.select(g.take(x), g.take(q_residual), g.take(positions), index_keys,
                                             visible)  # (G, Q, k)
                rows = slots.gather(1, picks.clamp(min=0).flatten(1)).view(picks.shape)
                sources.append(self._keys(kv.fp8_entry, entries, rows.masked_fill(picks < 0, -1)))
            else:
                sources.append(self._keys(kv.fp8_entry, entries, slots, visible))
        qg = g.take(q).view(g.num_seqs, g.q_len, layer.num_heads, layer.head_dim)
        out = self.kernels.attention.sparse_mqa_attention(qg, sources, layer.attn_sink, layer.head_dim ** -0.5,
                                                          pdl=self.pdl)
        return out.view(-1, layer.num_heads, layer.head_dim)

    def index_select(self, indexer: nn.Module, q: torch.Tensor, keys, weights: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
        """q (G*Q, H, Di) rotated, keys the group's index keys as a KeySource (buffer, rows (G, E), FP8 row
        scales or None), weights (G*Q, H), visible (G, Q, E) -> (G, Q, min(topk, E)) indices into the group's
        entries of the best visible ones by sum_h w_h * relu(q_h . k), -1 past the visible ones."""
        g, q_len, _ = visible.shape
        sort_keys = self.kernels.indexer.index_scores(
            q.view(g, q_len, indexer.num_heads, indexer.head_dim), weights.view(g, q_len, indexer.num_heads),
            keys.buf, keys.rows, visible, indexer.head_dim ** -0.5, keys.scales, as_keys=True, pdl=self.pdl)
        return topk_of_keys(sort_keys, indexer.topk)  # stable_topk's picks, from the keys the kernel wrote


def v4_kernels() -> SimpleNamespace:
    from deepinfer_kernels import (moe_router, v4_attention, v4_elementwise, v4_hyper,  # Triton: CUDA builds only
                                   v4_indexer, v4_pooling, v4_sinkhorn)
    return SimpleNamespace(attention=v4_attention, indexer=v4_indexer, pooling=v4_pooling, sinkhorn=v4_sinkhorn,
                           elementwise=v4_elementwise, hyper=v4_hyper, router=moe_router)


def key_source(kernels: SimpleNamespace, fp8: Fp8Rows | None, plain: torch.Tensor, rows: torch.Tensor,
                mask: torch.Tensor | None = None):
    """A key source over one kind of pool rows: the Fp8Rows' values and scales where the pool keeps them in FP8
    (the kernels dequantize in registers), else the 16-bit column view."""
    return (kernels.attention.KeySource(plain, rows, mask) if fp8 is None
            else kernels.attention.KeySource(fp8.values, rows, mask, fp8.scales))


class V4InvariantTritonMethod(V4InvariantMethod):
    """CUDA, batch-invariant: attention through the sparse MQA kernel in fixed-split mode and the indexer scores
    through its fixed-order mode (deepinfer_kernels.v4_attention / v4_indexer); every other form is
    V4InvariantMethod's.

    Attention has two key sources per query, each a list whose valid keys sit at positions that depend on the
    query alone: its visible sliding-window keys from position 0 (v4_invariant.sliding_rows, the sliding part
    of key_lists), then the entries at their entry indices (HCA: the group's entries 0..E-1 with its
    visibility) or, for CSA, the indexer's picks in stable top-k order (-1 past the visible ones). The kernel
    cuts every list into splits at absolute positions and merges them in a fixed order, so a query's output is
    bitwise the same alone, in a decode batch padded to any width or in a prefill chunk, FP8 pool or not.
    Against V4InvariantMethod (blocks of 64 keys merged in list order in torch) only the summation order
    differs: fp32 rounding (test/unit/test_triton_v4_invariant.py bounds the tiny model's logits at 1e-4)."""

    def __init__(self, linear: LinearMethod, activation: Activation, head_matmul: HeadMatmul):
        super().__init__(linear, activation, head_matmul)
        self.kernels = v4_kernels()

    def attend(self, layer: nn.Module, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
               positions: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        swa_rows = v4_invariant.sliding_rows(g.swa_slots, g.swa_mask)  # (G, Q, Ls)
        sources = [key_source(self.kernels, kv.fp8_swa, kv.recent[:, kv.cols.swa], swa_rows)]
        if layer.ratio:
            slots, visible = g.entry_slots[layer.ratio], g.entry_mask[layer.ratio]  # (G, E), (G, Q, E)
            entries = kv.entries[:, kv.cols.entry]
            if layer.indexer is not None:
                index_keys = key_source(self.kernels, kv.fp8_idx_entry, kv.entries[:, kv.cols.idx_entry], slots)
                picks = layer.indexer.select(g.take(x), g.take(q_residual), g.take(positions), index_keys,
                                             visible)  # (G, Q, k)
                rows = slots.gather(1, picks.clamp(min=0).flatten(1)).view(picks.shape)
                sources.append(key_source(self.kernels, kv.fp8_entry, entries, rows.masked_fill(picks < 0, -1)))
            else:
                sources.append(key_source(self.kernels, kv.fp8_entry, entries, slots, visible))
        qg = g.take(q).view(g.num_seqs, g.q_len, layer.num_heads, layer.head_dim)
        out = self.kernels.attention.sparse_mqa_attention(qg, sources, layer.attn_sink, layer.head_dim ** -0.5,
                                                          fixed_splits=True)
        return out.view(-1, layer.num_heads, layer.head_dim)

    def index_select(self, indexer: nn.Module, q: torch.Tensor, keys, weights: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
        """As V4TritonMethod.index_select (keys a KeySource, picks (G, Q, min(topk, E)), -1 past the visible
        ones), the scores in the kernel's fixed order: an entry's score and so the stable top-k over them are
        the same whatever the batch."""
        g, q_len, _ = visible.shape
        sort_keys = self.kernels.indexer.index_scores(
            q.view(g, q_len, indexer.num_heads, indexer.head_dim), weights.view(g, q_len, indexer.num_heads),
            keys.buf, keys.rows, visible, indexer.head_dim ** -0.5, keys.scales, fixed_order=True, as_keys=True)
        return topk_of_keys(sort_keys, indexer.topk)


@functools.cache
def v4_method(config: KernelConfig) -> V4Method:
    if config.is_batch_invariant:
        cls = V4InvariantTritonMethod if config.is_triton else V4InvariantMethod
    elif config.is_triton:
        return V4TritonMethod(linear_method(config), activation_method(config), head_matmul_method(config),
                              config.uses_pdl)
    else:
        cls = V4Method
    return cls(linear_method(config), activation_method(config), head_matmul_method(config))
