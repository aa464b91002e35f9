"""The torch attention backend's fast paths (views over consecutive slots, decode-only batches) against its
gathering, scattering path: the same outputs for the same KV."""
from __future__ import annotations

import torch

from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend, first_of_run

HQ, HKV, D = 4, 2, 8


def _run(pool, q_lens, kv_lens, kv_slots, q):
    t = sum(q_lens)
    slots = [torch.tensor(s) for s in kv_slots]
    out_slots = torch.cat([s[kv - n:] for s, n, kv in zip(slots, q_lens, kv_lens)])
    fb = ForwardBatch(torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long), out_slots, q_lens,
                      kv_lens, slots, pool, TorchRefBackend())
    fb.backend.prepare(fb)
    return fb.backend.forward(q, 0, D**-0.5, fb), fb.attn_meta


def _pool():
    torch.manual_seed(0)
    pool = KVPool(KVLayout(1, (HKV, D), (HKV, D), D), 64, 1, torch.float32, torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    return pool


def test_first_of_run():
    assert first_of_run(torch.tensor([5, 6, 7])) == 5
    assert first_of_run(torch.tensor([9])) == 9
    assert first_of_run(torch.tensor([5, 7, 6])) is None
    assert first_of_run(torch.tensor([5, 4, 7])) is None  # ends span 2 but not ascending by one


def test_single_decode_view_equals_gather():
    pool = _pool()
    q = torch.randn(1, HQ, D)
    # The same KV on consecutive slots 10..19 and on scattered slots.
    scattered = [40, 3, 22, 31, 8, 50, 1, 60, 27, 25]
    pool.k[0][scattered] = pool.k[0][10:20].clone()
    pool.v[0][scattered] = pool.v[0][10:20].clone()
    view, meta = _run(pool, [1], [10], [list(range(10, 20))], q)
    assert meta.decode_first_slot == 10
    gathered, meta = _run(pool, [1], [10], [scattered], q)
    assert meta.decode_first_slot is None
    torch.testing.assert_close(view, gathered, rtol=1e-6, atol=1e-6)


def test_decode_only_batch_equals_mixed_batch_rows():
    pool = _pool()
    q_dec = torch.randn(3, HQ, D)
    slots = [[1, 5, 9], [2, 6], [3, 7, 11, 13]]
    only, meta = _run(pool, [1, 1, 1], [3, 2, 4], slots, q_dec)
    assert meta.is_all_decode and meta.decode_kv is not None
    # The same decodes behind a 12-token prefill chunk (its rows first): the scatter path.
    q_ext = torch.randn(12, HQ, D)
    mixed, meta = _run(pool, [12, 1, 1, 1], [12, 3, 2, 4], [list(range(20, 32))] + slots, torch.cat([q_ext, q_dec]))
    assert not meta.is_all_decode and meta.extends[0].first_slot == 20
    torch.testing.assert_close(only, mixed[12:], rtol=0, atol=0)
    ext_gathered, _ = _run(pool, [12], [12], [list(range(20, 32))], q_ext)
    torch.testing.assert_close(mixed[:12], ext_gathered, rtol=0, atol=0)


def test_heads_view_is_the_transposed_span():
    from deepinfer_rt.layers.attention.torch_ref import _heads_view

    pool = _pool()
    for buf in (pool.k[0], pool.v[0], pool.k[0][2:]):  # also a buffer that starts inside its storage
        want = buf.narrow(0, 5, 11).transpose(0, 1)[None]
        got = _heads_view(buf, 5, 11)
        assert got.shape == want.shape and got.stride()[1:] == want.stride()[1:] and torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr()  # a view, not a copy


def test_a_second_lone_stream_reads_the_pool_as_a_view(tiny_llama_path, monkeypatch):
    """After a first request finishes, the next lone stream gets its pages back in order (PageAllocator, and the
    scheduler frees a request's spare pages before its own), so its decode steps take the view path."""
    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.layers.attention import torch_ref

    firsts = []

    def recording(slots):
        firsts.append(torch_ref.first_of_run.__wrapped__(slots))
        return firsts[-1]

    recording.__wrapped__ = torch_ref.first_of_run
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine(str(tiny_llama_path), dtype="float32", device="cpu", kv_cache_tokens=256,
                enable_prefix_cache=False) as engine:
        engine.generate(input_ids=[[3, 4, 5, 6, 7]], sampling_params=params)
        monkeypatch.setattr(torch_ref, "first_of_run", recording)
        engine.generate(input_ids=[[8, 9, 10, 11]], sampling_params=params)
    assert len(firsts) >= 10 and all(f is not None for f in firsts), firsts
