"""The torch backend's batched path for short extends (verification rows) equals the per-sequence path."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention import torch_ref
from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend


@pytest.mark.parametrize("gqa", [True, False])
def test_short_extends_match_per_sequence_attention(monkeypatch, gqa):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 4, 2 if gqa else 4, 8
    pool = KVPool(KVLayout(1, (hkv, d), (hkv, d), d), 64, 1, torch.float32, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    q_lens, kv_lens = [1, 3, 6, 2, 12], [5, 9, 6, 20, 14]  # decode, short extends, a long extend
    perm = torch.randperm(64, generator=gen)
    kv_slots, offset = [], 0
    for n in kv_lens:
        kv_slots.append(perm[offset : offset + n])
        offset = (offset + n) % 40
    total = sum(q_lens)
    q = torch.randn(total, hq, d, generator=gen)

    def run() -> tuple[torch.Tensor, bool]:
        fb = ForwardBatch(torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.long),
                          torch.zeros(total, dtype=torch.long), q_lens, kv_lens, kv_slots, pool, TorchRefBackend())
        fb.backend.prepare(fb)
        return fb.backend.forward(q, 0, d**-0.5, fb), fb.attn_meta.short is not None

    batched, used_short = run()
    monkeypatch.setattr(torch_ref, "_SHORT_QUERY", 1)
    reference, used_short_after = run()
    assert used_short and not used_short_after
    torch.testing.assert_close(batched, reference, rtol=1e-5, atol=1e-5)
