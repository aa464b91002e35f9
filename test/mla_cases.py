"""One MLA layer of a tiny DeepSeek checkpoint over hand-built batches: the absorbed form against the standard
(MHA) prefill form, shared by the CPU and GPU tests."""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend
from deepinfer_rt.layers.mla import MLAttention
from deepinfer_rt.layers.mla_prefill import build_plan
from deepinfer_rt.models.loader import build_model, load_model_config

CASES = {
    "fresh_prompt": [(0, 20)],
    "chunk_after_prefix": [(18, 12)],
    # decode rows, a short extend (speculative verification), a chunk over a prefix and a fresh prompt
    "mixed": [(9, 1), (0, 16), (25, 1), (10, 3), (7, 11)],
}
"""Each sequence as (cached prefix length, new tokens)."""


def load_layer(path: Path, dtype: torch.dtype, device: torch.device, num_slots: int = 256
               ) -> tuple[MLAttention, KVPool]:
    """The first MLA layer of the checkpoint, and a pool of num_slots slots, each holding random latents."""
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", dtype, device, seed=0)
    layer = next(m for m in model.modules() if isinstance(m, MLAttention))
    pool = KVPool(model.kv_layout(config), num_pages=num_slots, page_size=1, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    pool.k[layer.layer_id].copy_(torch.randn(pool.k[layer.layer_id].shape, generator=g, device=device))
    return layer, pool


def make_batch(layer: MLAttention, pool: KVPool, backend: AttentionBackend, seqs: list[tuple[int, int]],
               seed: int) -> tuple[ForwardBatch, torch.Tensor]:
    """A prepared batch of `seqs` (prefix, new) on disjoint slots (in a scrambled order), and its hidden states."""
    dev = pool.k[0].device
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(pool.num_slots, generator=g).to(dev)
    positions, out_slots, kv_slots, start = [], [], [], 0
    for prefix, new in seqs:
        slots = order[start : start + prefix + new]
        start += prefix + new
        kv_slots.append(slots)
        positions.append(torch.arange(prefix, prefix + new, device=dev))
        out_slots.append(slots[prefix:])
    t = sum(new for _, new in seqs)
    batch = ForwardBatch(input_ids=torch.zeros(t, dtype=torch.long, device=dev), positions=torch.cat(positions),
                         out_slots=torch.cat(out_slots), q_lens=[n for _, n in seqs],
                         kv_lens=[p + n for p, n in seqs], kv_slots=kv_slots, pool=pool, backend=backend)
    backend.prepare(batch)
    hidden = torch.randn(t, layer.o_proj.out_features, generator=g).to(device=dev, dtype=pool.k[0].dtype)
    return batch, hidden


def both_forms(layer: MLAttention, pool: KVPool, backend: AttentionBackend, seqs: list[tuple[int, int]],
               min_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer output with every row absorbed, and with chunks of >= min_queries new tokens in the MHA form."""
    outs = []
    for mha in (False, True):
        batch, hidden = make_batch(layer, pool, backend, seqs, seed=1)
        batch.mla_plan = build_plan(batch, min_queries if mha else None)
        assert bool(batch.mla_plan.segments) == (mha and max(n for _, n in seqs) >= min_queries)
        with torch.no_grad():
            outs.append(layer(hidden, batch))
    return outs[0], outs[1]
