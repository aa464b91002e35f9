"""DeepSeek-V4.1 attention over the KV pool: a sliding window on every layer, plus (ratio 1 / 2) the indexer's top-k of
the latest KV source's compressed entries.

Pool columns per token slot and layer (D = head_dim, Di = index_head_dim):

    every layer                    [ swa D ]
    KV source, ratio 1             [ swa D | entry D | index_key Di ]
    KV source, ratio 2             [ swa D | entry D | index_key Di | kv D | gate D ]
    the first Engram layer         ... | 3 columns: the token's compressed id in base-256 digits

`swa` is the token's normalised, rotated key (= value), from the YOCO shared hidden on consumer layers. On a ratio-1
source every position is an entry: `entry` / `index_key` of a slot belong to that token. On a ratio-2 source
`kv` / `gate` are the compressor's raw projections of the token, and `entry` / `index_key` are meaningful only in
the slot of a window's second token, written when that token is computed. The index key is a projection
(linear + RMSNorm) of the entry *before* its RoPE, then rotated like the entry. Everything is a function of the
token's prefix, so a prefix-cache hit at any position restores the state exactly and freeing slots frees it all.

That is the per-token layout (DEEPINFER_V4_KV_LAYOUT=per_token). The compact pool (models/deepseek_v4/cache.py)
keeps [ entry D | index_key Di ] of KV sources in entry rows (one per token at ratio 1, per window at ratio 2)
and [ swa D | kv D | gate D | ids 3 ] in recent rows, held only near sequence ends and checkpoints (v41_layer_kv).
With kv_cache_dtype='fp8_e4m3' the sliding keys, entries and index keys are float8 e4m3 rows with an fp32 scale
per row (V4's Fp8Rows, quantized as they are stored); the compressor inputs and the ids stay in the model dtype.
With 'fp4_e2m1' the sliding keys are the same FP8 rows and the entries and index keys MXFP4 rows (V4's Fp4Rows: e2m1
values, an e8m0 scale per 32): 340 bytes per entry and index key of a 512 + 128 wide source.

Per step, index sources keep their top-k selection per attention group on the step state (`V41Step.picks`) for the
layers that reuse it; the candidate source keeps its block set there (`V41Step.candidates`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer_kernels.reference import stable_topk, stable_topk_keys, topk_of_keys
from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import GroupedLinear, Linear
from deepinfer_rt.layers.methods import linear_method
from deepinfer_rt.models.deepseek_v4.batch import AttnGroup, V4Batch
from deepinfer_rt.models.deepseek_v4.cache import V4Pool
from deepinfer_rt.models.deepseek_v4.common import LayerKV, PoolColumns, V4RMSNorm, V4Rotary
from deepinfer_rt.models.deepseek_v41.config import V41Config, V41Layer
from deepinfer_rt.models.deepseek_v41.methods import v41_method


@dataclass
class V41Step:
    """Per-step metadata (built by prepare_batch) and the cross-layer results of this step's forward."""

    vb: V4Batch
    engram_rows: dict[int, torch.Tensor]
    """Engram layer -> (T, cols) table rows of the step's tokens."""
    compressed_ids: torch.Tensor
    """(T,) compressed ids of the step's tokens (kept in the first Engram layer's pool columns)."""
    picks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(index source layer, group index) -> (G, Q, min(index_topk, E)) int64 indices into the group's entries
    (entry_slots columns) of the selected ones, best first, -1 past the visible ones (fewer than index_topk)."""
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    """group index -> (G, Q, E) entries inside the candidate source's blocks."""
    shared_hidden: torch.Tensor | None = None
    query_vb: V4Batch | None = None
    """YOCO prefill truncation: the attention groups of the rows the consumer layers compute (None = all rows)."""
    keep: torch.Tensor | None = None
    """Those rows' indices among the step's tokens."""

    def for_step(self) -> "V41Step":
        """The step's metadata: built already (a CUDA-graph step's V41StaticDecode computes it here instead)."""
        return self


def kept_linear_method():
    """The compressor's wkv / wgate and the indexer's wk / weights_proj stay 16/32-bit in the release (no `.scale`
    beside them, as in V4), so they keep the unquantized method under any quantization."""
    return linear_method(current_kernel_config())


@functools.cache
def _columns(d: int, di: int) -> tuple[dict[bool, PoolColumns], PoolColumns]:
    """V4.1's state in V4's column names (models/deepseek_v4/common.py PoolColumns): swa, kv, gate (a ratio-2
    source's compressor inputs) in recent rows, entry and idx_entry (the index key) in entry rows. Returns the
    compact pool's columns without (False) and with (True) FP8 rows, and the per-token layout's."""
    empty = slice(0, 0)
    compact = PoolColumns(slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d), slice(0, d), empty, empty,
                          slice(d, d + di))
    # FP8: the sliding key, the entry and the index key are Fp8Rows of their own; the recent row keeps the rest
    fp8 = PoolColumns(empty, slice(0, d), slice(d, 2 * d), empty, empty, empty, empty)
    per_token = PoolColumns(slice(0, d), slice(2 * d + di, 3 * d + di), slice(3 * d + di, 4 * d + di),
                            slice(d, 2 * d), empty, empty, slice(2 * d, 2 * d + di))
    return {False: compact, True: fp8}, per_token


def v41_layer_kv(pool: KVPool, cfg: V41Config, layer_id: int) -> LayerKV:
    """A layer's state in the pool (deepseek_v4/common.py LayerKV): `recent` rows [swa D | kv D | gate D | ids 3]
    (16-bit compact pool; [kv D | gate D | ids 3] with FP8 rows), `entries` rows [entry D | index key Di]; the
    same rows in the per-token layout. The Engram ids are a recent row's last columns in every layout."""
    compact, per_token = _columns(cfg.head_dim, cfg.index_head_dim)
    if isinstance(pool, V4Pool):
        return pool.layer_kv(layer_id, compact)
    buf = pool.k[layer_id].view(pool.num_slots, -1)
    return LayerKV(buf, buf, per_token)


def recent_width(cfg: V41Config, spec: V41Layer) -> int:
    """Compact pool: a layer's recent row (the sliding key, a ratio-2 source's compressor inputs, the ids)."""
    d = cfg.head_dim
    return d + (2 * d if spec.is_kv_source and spec.ratio == 2 else 0) + (3 if spec.engram_slot == 0 else 0)


def pool_width(cfg: V41Config, spec: V41Layer) -> int:
    d, di = cfg.head_dim, cfg.index_head_dim
    width = d
    if spec.is_kv_source:
        width += d + di + (2 * d if spec.ratio == 2 else 0)
    if spec.engram_slot == 0:
        width += 3
    return width


class V41Compressor(nn.Module):
    """A KV source's compressor and index-key projection. Names: attn.compressor.{wkv, wgate, norm},
    attn.indexer.{wk, k_norm}."""

    def __init__(self, cfg: V41Config, ratio: int, rotary: V4Rotary):
        super().__init__()
        d, di = cfg.head_dim, cfg.index_head_dim
        self.ratio, self.rotary, self.d, self.di = ratio, rotary, d, di
        kept = kept_linear_method()
        self.wkv = Linear(cfg.hidden_size, d, method=kept)
        self.wgate = Linear(cfg.hidden_size, d, method=kept) if ratio == 2 else None
        self.norm = V4RMSNorm(d, cfg.rms_norm_eps)
        self.method = v41_method(current_kernel_config()).v4

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """A pooling compressor's products run in fp32 (forward): its weights (16-bit in the releases) kept in fp32,
        exact, instead of cast at every step (two launches, and each weight read and written again)."""
        if self.ratio == 2:
            for linear in (self.wkv, self.wgate):
                linear.weight.data = linear.weight.data.float()

    def _write(self, pre: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, kv: LayerKV,
               index_wk: Linear, index_norm: V4RMSNorm) -> None:
        cos, sin = self.rotary.cos_sin(positions)
        kv.store_entry(rows, self.method.rope(pre, cos, sin))
        kv.store_idx_entry(rows, self.method.rope(index_norm(index_wk(pre)), cos, sin))

    def forward(self, kv_x: torch.Tensor, vb: V4Batch, kv: LayerKV, index_wk: Linear,
                index_norm: V4RMSNorm) -> None:
        if self.ratio == 1:  # every token is a window of one: its entry row is windows[1].end
            self._write(self.norm(self.wkv(kv_x)), vb.positions, vb.windows[1].end, kv, index_wk, index_norm)
            return
        # The pooling compressor runs in fp32 (its projections and the softmax over the window).
        xf, buf, c = kv_x.float(), kv.recent, kv.cols
        linear = self.method.linear.linear
        buf[vb.out_slots, c.kv] = linear(xf, self.wkv.weight.float()).to(buf.dtype)
        buf[vb.out_slots, c.gate] = linear(xf, self.wgate.weight.float()).to(buf.dtype)
        win = vb.windows[2]
        if win.num == 0:
            return
        pooled = self.method.window_pool(buf, c.kv, c.gate, win, None, self.d, False, fp32=True)  # pairs, in fp32
        # the pooled entry leaves the fp32 compressor in the model's dtype, as the per-token ratio-1 entries are
        self._write(self.norm(pooled).to(kv_x.dtype), win.positions, win.end, kv, index_wk, index_norm)


class V41Attention(nn.Module):
    def __init__(self, cfg: V41Config, spec: V41Layer, rotary: V4Rotary):
        super().__init__()
        self.spec, self.cfg, self.rotary = spec, cfg, rotary
        h, d = cfg.num_heads, cfg.head_dim
        self.num_heads, self.head_dim = h, d
        q_out = h * d + (cfg.index_n_heads * cfg.index_head_dim if spec.is_index_source else 0)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, q_out)
        self.wkv = Linear(cfg.hidden_size, d)
        self.norm = V4RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(h))
        self.compressor = V41Compressor(cfg, spec.ratio, rotary) if spec.is_kv_source else None
        self.indexer = nn.Module()
        if spec.is_kv_source:
            self.indexer.wk = Linear(d, cfg.index_head_dim, method=kept_linear_method())
            self.indexer.k_norm = V4RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        if spec.is_index_source:
            self.indexer.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, method=kept_linear_method())
        self.method = v41_method(current_kernel_config())
        """Default or batch-invariant attention, indexer scores and products (deepseek_v41/methods.py)."""

    def forward(self, x: torch.Tensor, kv_x: torch.Tensor, step: V41Step, pool: KVPool) -> torch.Tensor:
        """x (Q, hidden) the queries' rows, kv_x (T, hidden) every token's KV input (Q < T only for YOCO consumers
        under prefill truncation)."""
        spec, vb, t = self.spec, step.vb, x.shape[0]
        qvb = step.query_vb if spec.is_yoco_consumer and step.query_vb is not None else vb
        h, d = self.num_heads, self.head_dim
        kv = v41_layer_kv(pool, self.cfg, spec.layer_id)
        kv_cos, kv_sin = self.rotary.cos_sin(vb.positions)
        cos, sin = (kv_cos, kv_sin) if qvb is vb else self.rotary.cos_sin(qvb.positions)
        q_all = self.wq_b(self.q_norm(self.wq_a(x)))
        q = self.method.v4.rope_(q_all[:, : h * d].view(t, h, d), cos, sin)  # V4.1: no per-head q norm
        kv.store_swa(vb.out_slots, self.method.v4.rope_(self.norm(self.wkv(kv_x)), kv_cos, kv_sin))
        if self.compressor is not None:
            self.compressor(kv_x, vb, kv, self.indexer.wk, self.indexer.k_norm)
        src = None if spec.kv_source is None else v41_layer_kv(pool, self.cfg, spec.kv_source)
        iq = weights = None
        if spec.is_index_source:
            cfg = self.cfg
            iq = self.method.v4.rope(q_all[:, h * d :].view(t, cfg.index_n_heads, cfg.index_head_dim), cos, sin)
            weights = self.indexer.weights_proj(x).float() * cfg.index_n_heads ** -0.5
        out = None if len(qvb.groups) == 1 and qvb.groups[0].covers_all else torch.empty_like(q)
        for gi, group in enumerate(qvb.groups):
            sel = None
            if spec.has_long_range:
                sel = self._select(gi, group, iq, weights, src, group.entry_slots[spec.ratio], step)
            attended = self.method.attend(group.take(q), group, spec.ratio, kv, src, sel, self.attn_sink)
            if out is None:
                out = attended
            else:
                out[group.rows] = attended
        out = self.method.v4.rope_(out, *self.rotary.cos_sin(qvb.positions, inverse=True))  # undo V's rotation
        grouped = self.wo_a.project(out.reshape(t, self.cfg.o_groups, -1), self.method.v4.grouped_projection)
        return self.wo_b(grouped.reshape(t, -1))

    def _select(self, gi: int, g: AttnGroup, iq, weights, src: LayerKV, slots, step: V41Step) -> torch.Tensor:
        """(G, Q, k) entries this layer's queries attend to, as indices into the group's entries (-1 = none): its
        own indexer top-k on an index source (inside the candidate blocks when it follows the candidate source),
        the index source's otherwise. Ties go to the lower entry index (stable_topk, as V4's indexer)."""
        spec, cfg = self.spec, self.cfg
        if not spec.is_index_source:
            return step.picks[(spec.index_source, gi)]
        visible = g.entry_mask[spec.ratio]
        n, q_len, num_entries = visible.shape
        q = g.take(iq).view(n, q_len, cfg.index_n_heads, cfg.index_head_dim)
        weights = g.take(weights).view(n, q_len, -1)
        if spec.is_candidate_source:  # its scores choose the candidate blocks too
            scores = self.method.index_scores(q, src, slots, weights).masked_fill(~visible, float("-inf"))
            step.candidates[gi] = self._candidate_blocks(scores, visible)
            picks = topk_of_keys(stable_topk_keys(scores), cfg.index_topk)
        else:  # the candidate blocks hold visible entries only
            mask = visible if spec.candidate_source is None else step.candidates[gi]
            picks = self.method.index_picks(q, src, slots, weights, mask, cfg.index_topk)
        step.picks[(spec.layer_id, gi)] = picks
        return picks

    def _candidate_blocks(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Entries in the query's newest block and in the top candidate_topk_blocks - 1 other blocks by block max."""
        b = self.cfg.candidate_block_size
        n, q_len, num_entries = scores.shape
        num_blocks = -(-num_entries // b)
        padded = torch.full((n, q_len, num_blocks * b), float("-inf"), dtype=scores.dtype, device=scores.device)
        padded[..., :num_entries] = scores
        block_max = padded.view(n, q_len, num_blocks, b).amax(dim=-1)
        newest = ((visible.sum(dim=-1) - 1).clamp(min=0) // b)  # (G, Q)
        block_max = block_max.scatter(-1, newest[..., None], float("inf"))
        top = stable_topk(block_max, self.cfg.candidate_topk_blocks)[1]
        chosen = torch.zeros(n, q_len, num_blocks, dtype=torch.bool, device=scores.device).scatter_(-1, top, True)
        entry_block = torch.arange(num_entries, device=scores.device) // b
        return chosen[..., entry_block] & visible

