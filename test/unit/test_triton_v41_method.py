"""V41TritonMethod (the CUDA default for DeepSeek-V4.1 outside batch-invariant mode) against V41Method, the torch
forms, under Triton's interpreter (a subprocess, as test_triton_interpreted.py), with the attention kernel's key
tiles scaled down to 16 so that key lists span several tiles and splits.

Method level (fast): the tiny config 'a' widths (window 16 is widened to 20 here: sliding lists of two tiles), a
step of a 30-token prefill chunk in query blocks of 8, a 9-token chunk at position 10 and a decode row at 40, over
random 16-bit and FP8 pool rows (LayerKV; FP8 through Fp8Rows as the pool stores them). Attention over the sliding
keys alone and with a random top-k selection of ratio-1 / ratio-2 entries (the index form: (G, Q, k) entry
indices, -1 past the visible ones, which early rows have fewer of than k), and the indexer scores over the visible
entries, agree within 1e-5 (fp32: only the summation order differs; the kernels read FP8 rows as float8 values
times their row scales, the torch forms the dequantized rows). The index form also agrees within 1e-5 with the
kernel's mask form (every entry of the group read, the same selection as a (G, Q, E) mask).

Model level (slow): the tiny model 'a' with every V4.1 / V4 method replaced by its Triton form (V41TritonMethod over
V4TritonMethod: attention, indexer, mHC Sinkhorn, compressor pooling) gives the torch forms' logits within 1e-4 over
a prefill chunk and two decode steps, on the 16-bit and the FP8 compact pool.
"""
from __future__ import annotations

import textwrap

import pytest

from test_triton_interpreted import _interpret

pytest.importorskip("triton")

_METHODS = textwrap.dedent("""
    from pathlib import Path

    import torch
    from deepinfer_kernels import v4_attention as va
    from helpers import chunk_batch
    from deepinfer_rt.layers.kernel_config import KernelConfig
    from deepinfer_rt.models.deepseek_v4.batch import build_v4_batch
    from deepinfer_rt.models.deepseek_v4.common import Fp8Rows, LayerKV, PoolColumns
    from deepinfer_kernels.reference import stable_topk
    from deepinfer_rt.models.deepseek_v4.methods import V4TritonMethod, key_source, v4_kernels, v4_method
    from deepinfer_rt.models.deepseek_v41.config import V41Config
    from deepinfer_rt.models.deepseek_v41.methods import (V41InvariantTritonMethod, V41Method, V41TritonMethod,
                                                          picked_mask, v41_method)
    from deepinfer_rt.models.loader import load_model_config

    va.BLOCK_N = 16
    torch.set_grad_enabled(False)
    config, _ = load_model_config(Path(PATH))
    cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
    cuda = KernelConfig(device_type="cuda")
    assert type(v41_method(cuda)) is V41TritonMethod and type(v41_method(cuda).v4) is V4TritonMethod
    assert type(v41_method(KernelConfig(device_type="cuda", is_batch_invariant=True))) is V41InvariantTritonMethod
    v4 = v4_method(KernelConfig())
    reference, triton = V41Method(v4), V41TritonMethod(v4)
    g = torch.Generator().manual_seed(0)
    num_slots, d, di, hi = 256, cfg.head_dim, cfg.index_head_dim, cfg.index_n_heads
    window = 20

    def layer_kv(fp8):
        swa, entry, index = (torch.randn(num_slots, w, generator=g) for w in (d, d, di))
        if not fp8:
            cols = PoolColumns(slice(0, d), *(slice(0, 0),) * 2, slice(0, d), *(slice(0, 0),) * 2, slice(d, d + di))
            return LayerKV(swa, torch.cat([entry, index], dim=1), cols)
        empty = slice(0, 0)
        kv = LayerKV(torch.zeros(num_slots, 0), torch.zeros(num_slots, 0), PoolColumns(*(empty,) * 7),
                     *(Fp8Rows.zeros(num_slots, w, torch.device("cpu")) for w in (d, d, di)))
        rows = torch.arange(num_slots)
        kv.store_swa(rows, swa)
        kv.store_entry(rows, entry)
        kv.store_idx_entry(rows, index)
        return kv

    chunks = [(0, 0, 30), (64, 10, 19), (128, 40, 41)]  # (first slot, start, end)
    batch = chunk_batch([(None, torch.arange(b, b + e), s, e) for b, s, e in chunks])
    vb = build_v4_batch(batch, window, (1, 2), 8)
    assert len(vb.groups) >= 2 and any(gr.q_len > 1 for gr in vb.groups) and any(gr.q_len == 1 for gr in vb.groups)
    t = batch.positions.shape[0]
    q = torch.randn(t, cfg.num_heads, d, generator=g)
    iq, w = torch.randn(t, hi, di, generator=g), torch.randn(t, hi, generator=g)
    sink = torch.randn(cfg.num_heads, generator=g)
    kernels, inf = v4_kernels(), float("inf")
    checked, fewer = 0, False
    for fp8 in (False, True):
        kv, src = layer_kv(fp8), layer_kv(fp8)
        for gr in vb.groups:
            n, q_len = gr.num_seqs, gr.q_len
            outs = [m.attend(q[gr.rows], gr, 1, kv, None, None, sink) for m in (reference, triton)]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
            for ratio in (1, 2):
                visible = gr.entry_mask[ratio]
                slots = gr.entry_slots[ratio]
                # the indexer's form: top-k of random scores over the visible entries, -1 past them (k = 9 is
                # more than the early rows' visible entries); the mask form scatters the same picks
                values, picks = stable_topk(torch.rand(visible.shape, generator=g).masked_fill(~visible, -inf), 9)
                picks = picks.masked_fill(values == -inf, -1)
                fewer |= bool((picks < 0).any())
                mask = picked_mask(picks, visible.shape[-1])
                assert int(mask.sum()) == int((picks >= 0).sum()) and not (mask & ~visible).any()
                outs = [m.attend(q[gr.rows], gr, ratio, kv, src, picks, sink) for m in (reference, triton)]
                torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
                # the kernel's former mask form: every entry of the group, the picks as the mask
                sources = [key_source(kernels, kv.fp8_swa, kv.recent[:, kv.cols.swa], gr.swa_slots, gr.swa_mask),
                           key_source(kernels, src.fp8_entry, src.entries[:, src.cols.entry], slots, mask)]
                masked = va.sparse_mqa_attention(q[gr.rows].view(n, q_len, -1, d), sources, sink, d ** -0.5)
                torch.testing.assert_close(outs[1], masked.view(outs[1].shape), rtol=1e-5, atol=1e-5)
                iqg, wg = iq[gr.rows].view(n, q_len, hi, di), w[gr.rows].view(n, q_len, hi)
                scores = [m.index_scores(iqg, src, slots, wg).masked_fill(~visible, float("-inf"))
                          for m in (reference, triton)]
                torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-5)
                checked += int(visible.sum())
    assert checked > 100 and fewer, (checked, fewer)
    print("ok", checked)
""")

_MODEL = textwrap.dedent("""
    from pathlib import Path

    import torch
    from deepinfer_kernels import v4_attention as va
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend
    from deepinfer_rt.models.deepseek_v4.methods import V4Method, V4TritonMethod
    from deepinfer_rt.models.deepseek_v41.methods import V41Method, V41TritonMethod
    from deepinfer_rt.models.loader import build_model, load_model_config

    va.BLOCK_N = 16
    torch.set_grad_enabled(False)
    path = Path(PATH)
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, torch.device("cpu"), seed=0)
    tokens = torch.randint(100, 20000, (40,), generator=torch.Generator().manual_seed(1))
    steps = [(0, 37), (37, 38), (38, 39)]

    def run(fp8):
        layout = model.kv_layout(config)
        pool = KVPool(layout.with_kv_dtype("fp8_e4m3") if fp8 else layout, 64, 4, torch.float32, torch.device("cpu"))
        assert pool.layout.is_fp8 == fp8
        out = []
        for s, e in steps:
            backend = TorchRefBackend()
            batch = ForwardBatch(input_ids=tokens[s:e], positions=torch.arange(s, e), out_slots=torch.arange(s, e),
                                 q_lens=[e - s], kv_lens=[e], kv_slots=[torch.arange(0, e)], pool=pool,
                                 backend=backend)
            backend.prepare(batch)
            model.prepare_batch(batch)
            out.append(model.compute_logits(model(batch)))
        return torch.cat(out)

    def swap(to_triton):
        count = 0
        for mod in model.modules():
            m = getattr(mod, "method", None)
            if to_triton and type(m) is V4Method:
                mod.method = V4TritonMethod(m.linear, m.activation, m.head_matmul)
            elif to_triton and type(m) is V41Method:
                mod.method = V41TritonMethod(V4TritonMethod(m.v4.linear, m.v4.activation, m.v4.head_matmul))
            else:
                continue
            count += 1
        return count

    reference = {fp8: run(fp8) for fp8 in (False, True)}
    assert swap(True) > 0
    for fp8 in (False, True):
        got = run(fp8)
        rows = got.isfinite().all(dim=-1)
        assert rows.sum() >= 3, int(rows.sum())
        torch.testing.assert_close(got[rows], reference[fp8][rows], rtol=1e-4, atol=1e-4)
    print("ok")
""")


def test_v41_triton_method_equals_torch_forms(tiny_v41_paths):
    assert _interpret(_METHODS.replace("PATH", repr(str(tiny_v41_paths["a"])))).strip().splitlines()[-1].startswith("ok")


@pytest.mark.slow
def test_v41_triton_method_model_logits_close(tiny_v41_paths):
    assert _interpret(_MODEL.replace("PATH", repr(str(tiny_v41_paths["a"])))).strip().endswith("ok")
