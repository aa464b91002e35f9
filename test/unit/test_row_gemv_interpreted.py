"""kernels/row_gemv.py through Triton's interpreter, against the module path's operations: the residual add and
RMSNorm (reference.rms_norm), the product, SiLU-and-mul. fp32 within 1e-5; fp16 within fp16's rounding."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_ROW_GEMV = textwrap.dedent("""
    import torch
    from deepinfer_kernels import reference
    from deepinfer_kernels.row_gemv import row_gemv, MAX_ROWS
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for t, k, n in ((1, 96, 40), (3, 200, 24), (MAX_ROWS, 64, 33), (2, 700, 9)):  # K, N off the tiles
            x = (torch.randn(t, k, generator=g) * 2).to(dtype)
            r = torch.randn(t, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            nw = (1 + torch.randn(k, generator=g) * 0.1).to(dtype)
            cfg = dict(BLOCK_N=8, BLOCK_K=64) if k < 500 else {}  # K in tiles (two passes); the rule: one pass
            mm = lambda a, b: (a.float() @ b.float().t()).to(dtype)
            torch.testing.assert_close(row_gemv(x, w, config=cfg), mm(x, w), rtol=tol, atol=tol)
            h = reference.rms_norm(x, nw, 1e-6)
            torch.testing.assert_close(row_gemv(x, w, norm_weight=nw, eps=1e-6, config=cfg), mm(h, w), rtol=tol,
                                       atol=tol)
            y, s = row_gemv(x, w, residual=r, norm_weight=nw, eps=1e-6, config=cfg)
            assert torch.equal(s, x + r)  # the sum the next layer starts from, rounded as the module path rounds it
            torch.testing.assert_close(y, mm(reference.rms_norm(x + r, nw, 1e-6), w), rtol=tol, atol=tol)
            gu = torch.cat([w, (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)])
            y, s = row_gemv(x, gu, residual=r, norm_weight=nw, eps=1e-6, silu_mul=True, config=cfg)
            want = reference.silu_and_mul(mm(reference.rms_norm(x + r, nw, 1e-6), gu))
            assert y.shape == (t, n) and torch.equal(s, x + r)
            torch.testing.assert_close(y, want, rtol=tol, atol=tol)
    # The QKV product with rotary and the K/V store (qkv_rope_store) against row_gemv + gqa_rope_store's ops.
    from deepinfer_kernels.row_gemv import qkv_rope_store
    from deepinfer_kernels.elementwise import rope_cache
    hq, hkv, d, k = 4, 2, 16, 80
    cos, sin = rope_cache(torch.randn(d // 2).abs(), 1.0, 64, torch.device("cpu"))
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for interleave in (False, True):
            for t in (1, 3):
                x, r = torch.randn(t, k, generator=g).to(dtype), torch.randn(t, k, generator=g).to(dtype)
                nw = (1 + torch.randn(k, generator=g) * 0.1).to(dtype)
                w = (torch.randn((hq + 2 * hkv) * d, k, generator=g) / k ** 0.5).to(dtype)
                pos, slots = torch.tensor([5, 0, 63])[:t], torch.tensor([2, -1, 6])[:t]
                kb, vb = torch.zeros(8, hkv, d, dtype=dtype), torch.zeros(8, hkv, d, dtype=dtype)
                cfg = dict(BLOCK_K=32) if t == 3 else None  # K in three tiles (two passes); the rule's one tile
                q, s = qkv_rope_store(x, w, hq, hkv, pos, cos, sin, interleave, kb, vb, slots, residual=r,
                                      norm_weight=nw, eps=1e-6, config=cfg)
                assert torch.equal(s, x + r)
                qkv = (reference.rms_norm(x + r, nw, 1e-6).float() @ w.float().t()).to(dtype).view(t, -1, d)
                rot = lambda z: reference.apply_rope(z, *[c[pos].repeat(1, 2) for c in (cos, sin)], interleave)
                want_q, want_k = rot(qkv[:, :hq].float()).to(dtype), rot(qkv[:, hq:hq + hkv].float()).to(dtype)
                torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
                real = slots >= 0
                torch.testing.assert_close(kb[slots[real]], want_k[real], rtol=tol, atol=tol)
                torch.testing.assert_close(vb[slots[real]], qkv[real, hq + hkv:], rtol=tol, atol=tol)
                untouched = torch.ones(8, dtype=torch.bool)
                untouched[slots[real]] = False
                assert not kb[untouched].any() and not vb[untouched].any()
    for bad in (dict(x=torch.randn(MAX_ROWS + 1, 32)), dict(w=torch.randn(8, 32, dtype=torch.float16))):
        try:
            row_gemv(bad.get("x", torch.randn(2, 32)), bad.get("w", torch.randn(8, 32)))
            raise AssertionError(f"accepted {bad}")
        except ValueError:
            pass
    print("ok")
""")


def test_row_gemv_with_norm_residual_and_silu_equals_module_ops():
    assert _interpret(_ROW_GEMV).strip().endswith("ok")


# A tiny Llama built with the GPU's methods, run interpreted: a step of a prompt and two decode rows (one of them a
# padding row of slot -1) through GpuRowStep and through the modules: the same hidden states within fp32 rounding,
# the same pool; a step of more rows than row_gemv takes runs the modules.
_ROW_STEP = textwrap.dedent("""
    import sys, tempfile, torch
    sys.path.insert(0, "scripts")
    from make_tiny_checkpoint import make_tiny_checkpoint
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.triton import TritonBackend
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.models.llama import LlamaForCausalLM
    from deepinfer_rt.models.llama_gpu_step import GpuRowStep
    from deepinfer_rt.models.llama_step import ModuleStep
    from deepinfer_rt.models.loader import load_model_config
    path = make_tiny_checkpoint("llama", tempfile.mkdtemp(), num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16)
    config, _ = load_model_config(path)
    torch.manual_seed(0)
    with build_context(KernelConfig(device_type="cuda")):
        model = LlamaForCausalLM(config)
    assert isinstance(model.step_method, GpuRowStep)
    for p in model.parameters():
        p.data.normal_(0, 0.2)

    def run(step, n_prompt, rope_store=True):
        pool = KVPool(LlamaForCausalLM.kv_layout(config), num_pages=96, page_size=1, dtype=torch.float32,
                      device=torch.device("cpu"))
        backend = object.__new__(TritonBackend)
        backend.num_sms, backend.is_rope_store_supported, backend.pdl = 4, rope_store, False
        torch.manual_seed(1)
        for layer in range(config.num_layers):
            pool.k[layer].normal_(), pool.v[layer].normal_()
        t = n_prompt + 2
        ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(2))
        positions = torch.tensor([*range(n_prompt), 7, 0])
        out_slots = torch.tensor([*range(10, 10 + n_prompt), 87, -1])
        batch = ForwardBatch(ids, positions, out_slots, [n_prompt, 1, 1], [n_prompt, 8, 1],
                             [torch.arange(10, 10 + n_prompt), torch.arange(80, 88), torch.tensor([90])], pool, backend)
        backend.prepare(batch)
        model.step_method = step
        with torch.no_grad():
            return model(batch), pool.k[0].clone(), pool.v[-1].clone()

    # 4 rows: the row step (QKV + rotary + store in one launch, or apart where the backend keeps the store);
    # 32 rows: past MAX_ROWS, the modules in both.
    import deepinfer_kernels.row_gemv as row_gemv_module
    calls = {"qkv_rope_store": 0, "row_gemv": 0}
    for name in calls:
        def counted(*a, inner=getattr(row_gemv_module, name), name=name, **k):
            calls[name] += 1
            return inner(*a, **k)
        setattr(row_gemv_module, name, counted)
    for n_prompt, rope_store in ((2, True), (2, False), (30, True)):
        before = dict(calls)
        (h, k, v) = run(GpuRowStep(), n_prompt, rope_store)
        (h_ref, k_ref, v_ref) = run(ModuleStep(), n_prompt, rope_store)
        row_step = n_prompt == 2  # which layers' launches the step ran: 3 or 4 products a layer, or none
        fused_layers = config.num_layers if row_step and rope_store else 0
        products = (3 if rope_store else 4) * config.num_layers if row_step else 0
        assert calls["qkv_rope_store"] - before["qkv_rope_store"] == fused_layers
        assert calls["row_gemv"] - before["row_gemv"] == products
        torch.testing.assert_close(h[:-1], h_ref[:-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
        if not row_step:
            assert torch.equal(h, h_ref)
    assert model.gpu_row_layers and len(model.gpu_row_layers) == config.num_layers
    print("ok")
""")


def test_llama_row_step_equals_module_path():
    assert _interpret(_ROW_STEP).strip().endswith("ok")
