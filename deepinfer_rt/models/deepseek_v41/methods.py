"""DeepSeek-V4.1's layer methods: default or batch-invariant, chosen once from the KernelConfig when a layer is built
(`self.method = v41_method(current_kernel_config())`).

What V4.1 shares with V4 (norms, hyper-connection mixes, router, experts, GEMMs, the compressor's window softmax, the
grouped output projection) is V4's method object (models/deepseek_v4/methods.py), held as `v4`. What differs is the
attention's key set (sliding-window keys of the layer, long-range entries of the KV source's layer, the selection
made by the index source), the indexer scores over those entries, and the DSpark block attention; their
batch-invariant forms reuse V4's per-query key lists and fixed-block online softmax (models/deepseek_v4/invariant.py).
"""
from __future__ import annotations

import functools

import torch

from deepinfer_kernels.reference import stable_topk_keys, topk_of_keys
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.models.deepseek_v4 import invariant as v4_invariant
from deepinfer_rt.models.deepseek_v4.batch import AttnGroup
from deepinfer_rt.models.deepseek_v4.common import LayerKV
from deepinfer_rt.models.deepseek_v4.methods import V4Method, key_source, v4_kernels, v4_method


def picked_mask(picks: torch.Tensor, num_entries: int) -> torch.Tensor:
    """picks (G, Q, k) indices into a group's entries, -1 = none -> (G, Q, num_entries) True at the picked ones
    (the torch forms' reading of a selection)."""
    mask = torch.zeros(*picks.shape[:2], num_entries + 1, dtype=torch.bool, device=picks.device)
    return mask.scatter_(-1, torch.where(picks < 0, num_entries, picks), True)[..., :num_entries]


def picked_rows(slots: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """slots (G, E) a group's entry rows, picks (G, Q, k) indices into them (-1 = none) -> (G, Q, k) the picked
    entry rows, -1 where there is no pick (a KeySource's rows: the kernel reads k entries per query, not E)."""
    rows = slots.gather(1, picks.clamp(min=0).flatten(1)).view(picks.shape)
    return rows.masked_fill(picks < 0, -1)


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """scores (..., H, L) -> softmax over [scores, sink_h] without the sink's column."""
    sink = sink.to(scores.dtype).view(*(1,) * (scores.dim() - 2), -1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


class V41Method:
    """The default forms (FP8 pool rows are dequantized in torch as they are gathered: LayerKV's readers)."""

    def __init__(self, v4: V4Method):
        self.v4 = v4

    def attend(self, q: torch.Tensor, g: AttnGroup, ratio: int, kv: LayerKV, src: LayerKV | None,
               selected: torch.Tensor | None, sink: torch.Tensor) -> torch.Tensor:
        """q (G*Q, H, D) the group's queries; kv this layer's state (its sliding-window keys), src the KV source's
        (its entries of `ratio`); selected (G, Q, k) the entries each query attends to, as indices into the
        group's entries (entry_slots[ratio]) with -1 for none (None: no long-range branch) -> (G*Q, H, D).
        The reference reads every entry of the group and masks the unpicked ones (picked_mask)."""
        h, d = q.shape[1:]
        keys, mask = kv.swa(g.swa_slots), g.swa_mask  # (G, L, D), (G, Q, L)
        if selected is not None:
            slots = g.entry_slots[ratio]
            keys = torch.cat([keys, src.entry(slots)], dim=1)
            mask = torch.cat([mask, picked_mask(selected, slots.shape[1])], dim=2)
        keys = keys.to(q.dtype)
        qg = q.view(g.num_seqs, g.q_len, h, d)
        scores = torch.einsum("gqhd,gld->gqhl", qg, keys) * d ** -0.5
        probs = _softmax_with_sink(scores.masked_fill(~mask[:, :, None, :], float("-inf")), sink)
        return torch.einsum("gqhl,gld->gqhd", probs.to(keys.dtype), keys).reshape(-1, h, d)

    def index_scores(self, q: torch.Tensor, src: LayerKV, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q (G, Q, H, Di) rotated index queries (model dtype), src the KV source's state, slots (G, E) its entry
        rows, weights (G, Q, H) fp32 -> (G, Q, E) fp32 sum_h w_h relu(q_h . k_e) * Di^-0.5 (in fp32)."""
        keys = src.idx_entry(slots).float()  # (G, E, Di)
        scores = torch.einsum("gqhd,ged->gqhe", q.float(), keys).relu() * q.shape[-1] ** -0.5
        return (scores * weights[..., None]).sum(dim=2)

    def index_picks(self, q: torch.Tensor, src: LayerKV, slots: torch.Tensor, weights: torch.Tensor,
                    mask: torch.Tensor, k: int) -> torch.Tensor:
        """(G, Q, min(k, E)) indices of the entries with the best index_scores among those `mask` (G, Q, E) allows,
        best first, ties to the lower entry (stable_topk), -1 past the allowed ones."""
        scores = self.index_scores(q, src, slots, weights).masked_fill(~mask, float("-inf"))
        return topk_of_keys(stable_topk_keys(scores), k)

    def draft_attend(self, q: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor, block: torch.Tensor,
                     sink: torch.Tensor) -> torch.Tensor:
        """The DSpark block attention. q (R, B, H, D), ctx (R, L, D) context keys (valid ones first), ctx_mask (R, L),
        block (R, B, D) the block's own keys, seen by every block row -> (R*B, H, D)."""
        r, b, h, d = q.shape
        keys = torch.cat([ctx, block], dim=1)
        mask = torch.cat([ctx_mask, ctx_mask.new_ones(r, b)], dim=1)
        scores = torch.einsum("rqhd,rld->rqhl", q, keys) * d ** -0.5
        probs = _softmax_with_sink(scores.masked_fill(~mask[:, None, None, :], float("-inf")), sink)
        return torch.einsum("rqhl,rld->rqhd", probs.to(keys.dtype), keys).reshape(r * b, h, d)

    def mean_streams(self, streams: torch.Tensor) -> torch.Tensor:
        """(T, N, D) -> (T, D) the mean over the streams (the DSpark feature capture)."""
        return streams.mean(dim=1)

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (T, K) @ w.T, w (N, K)."""
        return x @ w.T

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row softmax over the last dim."""
        return x.softmax(dim=-1)


class V41InvariantMethod(V41Method):
    """The batch-invariant forms: each query's own key list in fixed blocks, heads and streams added in order."""

    def attend(self, q, g, ratio, kv, src, selected, sink):
        entry_slots = entry_mask = None
        if selected is not None:  # the entries 0..E-1 in order after the sliding keys, the picked ones valid
            entry_slots = g.entry_slots[ratio]
            entry_mask = picked_mask(selected, entry_slots.shape[1])
        slots, valid, is_entry = v4_invariant.key_lists(g.swa_slots, g.swa_mask, entry_slots, entry_mask)
        if selected is None:
            keys = kv.swa(slots)
        else:  # the two lists index different buffers (the compact pool's recent rows and entry rows)
            zero = torch.zeros_like(slots)
            keys = torch.where(is_entry[..., None], src.entry(torch.where(is_entry, slots, zero)),
                               kv.swa(torch.where(is_entry, zero, slots)))
        return v4_invariant.attend(q, keys.to(q.dtype), valid, q.shape[-1] ** -0.5, sink)

    def index_scores(self, q, src, slots, weights):
        g, q_len, h, di = q.shape
        e = slots.shape[1]
        keys = src.idx_entry(slots).float()
        per_query = keys[:, None].expand(g, q_len, e, di).reshape(g * q_len, e, di)
        scores = v4_invariant.index_scores(q.float().reshape(g * q_len, h, di), per_query,
                                           weights.reshape(g * q_len, h), di ** -0.5)
        return scores.view(g, q_len, e)

    def draft_attend(self, q, ctx, ctx_mask, block, sink):
        """Per block row: its valid context keys in order, then the block's keys, in whole KEY_BLOCKs."""
        r, b, h, d = q.shape
        num_ctx = ctx.shape[1]
        width = -(-(num_ctx + b) // v4_invariant.KEY_BLOCK) * v4_invariant.KEY_BLOCK
        count = ctx_mask.sum(-1, keepdim=True)  # (R, 1)
        keys = ctx.new_zeros(r, width, d)
        keys[:, :num_ctx] = ctx.masked_fill(~ctx_mask[..., None], 0)
        pos = count + torch.arange(b, device=q.device)  # (R, B)
        keys = keys.to(q.dtype).scatter(1, pos[..., None].expand(r, b, d), block.to(q.dtype))
        valid = torch.arange(width, device=q.device) < count + b  # (R, W)
        keys = keys[:, None].expand(r, b, width, d).reshape(r * b, width, d)
        valid = valid[:, None].expand(r, b, width).reshape(r * b, width)
        return v4_invariant.attend(q.reshape(r * b, h, d), keys, valid, d ** -0.5, sink)

    def mean_streams(self, streams):
        return v4_invariant.ordered_sum(streams, dim=1) / streams.shape[1]

    def matmul(self, x, w):
        return self.v4.linear.mm(x, w.t())

    def softmax(self, x):
        return v4_invariant.one_row_safe(lambda r: r.softmax(dim=-1), x)


class _KernelForms:
    """Attention and the indexer scores through deepinfer_kernels.v4_attention / v4_indexer, reading the pool's rows
    where they are (V4's V4TritonMethod does the same): the sliding keys and the KV source's picked entries are two
    key sources of the sparse MQA kernel, the index keys the indexer kernel's rows. The entries come as each
    query's (G, Q, k) picked rows (picked_rows, -1 = none; V4's CSA path), so a query's long-range branch reads its
    k entries, not all E of the group, and no (G, Q, E) mask is built or read; FP8 rows come
    as float8 values with their row scales, MXFP4 rows ('fp4_e2m1' entries and index keys) as uint8 e2m1 pairs with
    their e8m0 block scales, both dequantized in registers. The index queries stay in the model dtype
    (the pool's: no copy of the keys is made). `is_fixed` picks the kernels' batch-invariant modes (fixed splits
    over per-query sliding lists from position 0, v4_invariant.sliding_rows; the indexer's fixed order)."""

    is_fixed = False

    def __init__(self, v4: V4Method):
        super().__init__(v4)
        self.kernels = v4_kernels()  # Triton: CUDA builds only
        self.pdl = v4.pdl
        """The kernels as programmatic dependent launches, as V4's (V4TritonMethod.pdl)."""

    def attend(self, q, g, ratio, kv, src, selected, sink):
        h, d = q.shape[1:]
        if self.is_fixed:
            rows, mask = v4_invariant.sliding_rows(g.swa_slots, g.swa_mask), None
        else:
            rows, mask = g.swa_slots, g.swa_mask
        sources = [key_source(self.kernels, kv.fp8_swa, kv.recent[:, kv.cols.swa], rows, mask)]
        if selected is not None:  # per query its k picked entry rows (rank order, -1 = none)
            rows = picked_rows(g.entry_slots[ratio], selected)
            fp4 = src.fp4_entry
            sources.append(key_source(self.kernels, src.fp8_entry, src.entries[:, src.cols.entry], rows) if fp4 is None
                           else self.kernels.attention.KeySource(fp4.values, rows, None, fp4.scales))
        out = self.kernels.attention.sparse_mqa_attention(q.view(g.num_seqs, g.q_len, h, d), sources, sink, d ** -0.5,
                                                          fixed_splits=self.is_fixed, pdl=self.pdl)
        return out.view(-1, h, d)

    def index_scores(self, q, src, slots, weights):
        return self._indexer(q, src, slots, weights, None, as_keys=False)

    def index_picks(self, q, src, slots, weights, mask, k):
        """The kernel applies the mask and writes stable_topk's sort keys; the top-k comes from them."""
        return topk_of_keys(self._indexer(q, src, slots, weights, mask, as_keys=True), k)

    def _indexer(self, q, src, slots, weights, mask, as_keys: bool) -> torch.Tensor:
        rows = src.fp8_idx_entry if src.fp8_idx_entry is not None else src.fp4_idx_entry
        buf, scales = (src.entries[:, src.cols.idx_entry], None) if rows is None else (rows.values, rows.scales)
        return self.kernels.indexer.index_scores(q, weights, buf, slots, mask, q.shape[-1] ** -0.5, scales,
                                                 fixed_order=self.is_fixed, as_keys=as_keys, pdl=self.pdl)


class V41TritonMethod(_KernelForms, V41Method):
    """CUDA, not batch-invariant (the default there): attention and the indexer scores through the kernels with
    splits chosen from the shapes (_KernelForms); the DSpark block attention and the other forms are V41Method's.
    Against V41Method only the summation order differs (fp32 softmax and accumulation in the kernels; in bf16 the
    products of bf16 rows): test/unit/test_triton_v41_method.py bounds it. Its engine test on the H200
    (test/gpu/test_gpu_deepseek_v41.py::test_cuda_triton_method_greedy_equals_cpu_engine: CUDA greedy tokens equal
    the CPU engine's) passed there with the 16-bit and FP8 pools; its MXFP4-pool cases have not run on a GPU yet."""


class V41InvariantTritonMethod(_KernelForms, V41InvariantMethod):
    """CUDA, batch-invariant: attention through the sparse MQA kernel in fixed-split mode and the indexer scores
    through its fixed-order mode, as V4's V4InvariantTritonMethod (models/deepseek_v4/methods.py): the sliding
    keys as a list of their own from position 0 (v4_invariant.sliding_rows), the KV source's picked entries at
    their top-k ranks (stable_topk over fixed-order scores: the same ranks in any batch; a wider batch only adds
    -1 after them, exact zeros). Against V41InvariantMethod (the entries 0..E-1 in order, the picked ones valid)
    only the summation order differs. The DSpark block attention and the other forms are V41InvariantMethod's."""

    is_fixed = True


@functools.cache
def v41_method(config: KernelConfig) -> V41Method:
    if config.is_batch_invariant:
        cls = V41InvariantTritonMethod if config.is_triton else V41InvariantMethod
    else:
        cls = V41TritonMethod if config.is_triton else V41Method
    return cls(v4_method(config))
