"""Batch-invariant forms of DeepSeek-V4's attention, indexer, compressor, routing and hyper-connection math
(models/deepseek_v4/methods.py V4InvariantMethod, which the layers get in batch-invariant mode).

A token's value must not depend on how many queries, sequences or chunks share its step. Besides the GEMMs
(fixed-shape tiles, layers/methods.py InvariantLinear) three things would break that:

  * Attention keys: a group's padded key set depends on its chunk (an extend group starts its sliding window
    at the chunk's first query) and on the other sequences (decode groups pad to the longest). Here each query
    gets its own key list — its visible sliding-window keys in position order, then the layer's compressed
    entries 0..E-1 in order — cut into KEY_BLOCK-key blocks counted from the start of that list. One
    fixed-shape GEMM per (query, block) gives scores, block max/sum/output; blocks are merged in list order
    (online softmax), and blocks past a query's list are masked, merging as an exact identity.
  * Sums over a middle dim (compressor window, MoE slots, hyper-connection streams) are written as adds in
    a fixed order, one rounding per add.
  * Top-k ties (relu'd indexer scores are often exactly equal): a stable sort picks the lowest entry index.
"""
from __future__ import annotations

import torch

from deepinfer_rt.layers.attention.batch_invariant import fixed_bmm

KEY_BLOCK = 64


def one_row_safe(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (a reduction over the last dim, row by row) on x; a single row is run as two, since torch may
    split a lone row's reduction across threads."""
    if x.numel() != x.shape[-1]:
        return fn(x)
    return fn(torch.cat([x.reshape(1, -1)] * 2))[:1].view(x.shape)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.sum(dim) as left-to-right adds."""
    parts = x.unbind(dim)
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x.clamp(max=20.0))))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _blocks(n: int) -> int:
    return max(1, -(-n // KEY_BLOCK))


def _block_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q (N, H, D), keys (N, B*KB, D) -> (N, B, H, KB) q.k, one fixed-shape GEMM per (query, block)."""
    n, h, d = q.shape
    nb = keys.shape[1] // KEY_BLOCK
    qi = q[:, None].expand(n, nb, h, d).reshape(n * nb, h, d)
    ki = keys.view(n * nb, KEY_BLOCK, d).transpose(1, 2)
    return fixed_bmm(qi, ki).view(n, nb, h, KEY_BLOCK)


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float,
           sink: torch.Tensor) -> torch.Tensor:
    """q (N, H, D); keys (N, L, D), L a multiple of KEY_BLOCK, each query's own list (K = V); valid (N, L);
    sink (H,) -> (N, H, D): softmax over [q.k * scale, sink] applied to the keys, blockwise in list order."""
    n, h, d = q.shape
    nb = keys.shape[1] // KEY_BLOCK
    keys = keys.masked_fill(~valid[..., None], 0)
    scores = (_block_scores(q, keys) * scale).masked_fill(~valid.view(n, nb, 1, KEY_BLOCK), float("-inf"))
    m = scores.amax(dim=-1)  # (N, B, H)
    p = torch.exp(scores - _finite(m)[..., None])
    l = p.sum(dim=-1)
    o = fixed_bmm(p.reshape(n * nb, h, KEY_BLOCK), keys.view(n * nb, KEY_BLOCK, d)).view(n, nb, h, d)
    acc_m, acc_l, acc_o = m[:, 0], l[:, 0], o[:, 0]
    for b in range(1, nb):
        acc_m, acc_l, acc_o = _merge(acc_m, acc_l, acc_o, m[:, b], l[:, b], o[:, b])
    s = sink.to(q.dtype).expand(n, h)
    acc_m, acc_l, acc_o = _merge(acc_m, acc_l, acc_o, s, torch.ones_like(s), torch.zeros_like(acc_o))
    return acc_o / acc_l[..., None]


def _finite(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _merge(m0, l0, o0, m1, l1, o1):
    m = torch.maximum(m0, m1)
    safe = _finite(m)
    a, c = torch.exp(m0 - safe), torch.exp(m1 - safe)
    return m, l0 * a + l1 * c, o0 * a[..., None] + o1 * c[..., None]


def _visible_first(swa_slots: torch.Tensor, swa_mask: torch.Tensor):
    """(G, Q, Ls) each query's visible sliding-window slots in position order then the others, (G, Q, Ls) whether
    a list position holds a visible key, (G, Q, 1) how many do."""
    g, q_len, ls = swa_mask.shape
    order = swa_mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True)  # visible first, in order
    slots = swa_slots[:, None].expand(g, q_len, ls).gather(-1, order)
    count = swa_mask.sum(-1, keepdim=True)
    return slots, torch.arange(ls, device=slots.device) < count, count


def sliding_rows(swa_slots: torch.Tensor, swa_mask: torch.Tensor) -> torch.Tensor:
    """(G, Q, Ls) per query: its visible sliding-window slots in position order from list position 0 (the
    sliding part of key_lists), -1 after them. swa_slots (G, Ls), swa_mask (G, Q, Ls).

    A query's list is the same in a prefill chunk and in a decode step, whatever its group: the fixed-split
    Triton attention (V4InvariantTritonMethod) reads it as a key source of its own beside the entries, whose
    list positions are their entry indices (or the query's top-k ranks), batch-independent too."""
    slots, valid, _ = _visible_first(swa_slots, swa_mask)
    return slots.masked_fill(~valid, -1)


def key_lists(swa_slots: torch.Tensor, swa_mask: torch.Tensor, entry_slots: torch.Tensor | None,
              entry_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query of a group: slots (G*Q, L), validity and is-entry flags of its key list — visible
    sliding-window keys in position order, then entries 0..E-1 — padded to whole KEY_BLOCKs.
    swa_slots (G, Ls), swa_mask (G, Q, Ls), entry_slots (G, E), entry_mask (G, Q, E)."""
    g, q_len, ls = swa_mask.shape
    slots, valid, count = _visible_first(swa_slots, swa_mask)
    is_entry = torch.zeros_like(valid)
    if entry_slots is not None:
        # Entries start at list index `count`: place them by scatter into a wider row.
        e = entry_slots.shape[1]
        width = ls + e
        pos = count + torch.arange(e, device=slots.device)  # (G, Q, E)
        slots = torch.cat([slots.masked_fill(~valid, 0), slots.new_zeros(g, q_len, e)], -1)
        valid = torch.cat([valid, valid.new_zeros(g, q_len, e)], -1)
        slots.scatter_(-1, pos, entry_slots[:, None].expand(g, q_len, e))
        valid.scatter_(-1, pos, entry_mask)
        is_entry = torch.cat([is_entry, is_entry.new_zeros(g, q_len, e)], -1).scatter_(-1, pos, True)
        ls = width
    padded = _blocks(ls) * KEY_BLOCK
    slots = torch.nn.functional.pad(slots, (0, padded - ls)).reshape(g * q_len, padded)
    valid = torch.nn.functional.pad(valid, (0, padded - ls)).reshape(g * q_len, padded)
    is_entry = torch.nn.functional.pad(is_entry, (0, padded - ls)).reshape(g * q_len, padded)
    return slots, valid, is_entry


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Indexer scores sum_h weights_h * relu(q_h . k_e) * scale: q (N, H, Di) fp32, keys (N, E, Di) fp32,
    weights (N, H) -> (N, E), entries taken in KEY_BLOCK blocks, heads added in order."""
    n, e = keys.shape[:2]
    padded = _blocks(e) * KEY_BLOCK
    keys = torch.nn.functional.pad(keys, (0, 0, 0, padded - e))
    s = _block_scores(q, keys).relu() * scale  # (N, B, H, KB)
    s = s * weights[:, None, :, None]
    return ordered_sum(s, dim=2).reshape(n, padded)[:, :e]


def top_k_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """(N, E) -> the k best visible entries per row (ties to the lowest index)."""
    scores = scores.masked_fill(~visible, float("-inf"))
    picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(visible).scatter_(-1, picks, True) & visible


def pool_window(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """kv (N, m, C), gate (N, m, C) fp32 -> softmax over the window of gate, weighted sum of kv (N, C)."""
    m = gate.amax(dim=1, keepdim=True)
    e = torch.exp(gate - m)
    w = (e / ordered_sum(e, dim=1)[:, None]).to(kv.dtype)
    return ordered_sum(kv * w, dim=1)


def hc_mix(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """einsum('tjk,tjd->tkd') as ordered adds over j."""
    n = comb.shape[1]
    return torch.stack([ordered_sum(comb[:, :, k, None] * streams, dim=1) for k in range(n)], dim=1)

