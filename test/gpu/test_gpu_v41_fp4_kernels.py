"""The sparse attention and indexer kernels reading MXFP4 rows (DeepSeek-V4.1's kv_cache_dtype='fp4_e2m1': entries
and index keys as e2m1 pairs with an e8m0 scale per 32 values, stored by the pool's Fp4Rows.write) at V4.1-Flash
shapes on CUDA, against the torch references over the same rows dequantized in fp32 (Fp4Rows.read).

Shapes: D = 512, H = 64 query heads, a 128-token sliding window as FP8 rows beside the top-512 MXFP4 entries, batch 1
and 64, a 64-query prefill block; the indexer at 32 heads of 128 over 8192 entries. Tolerances as the FP8 kernels'
(test_gpu_v4_kernels.py): the kernels dequantize a tile exactly into the queries' dtype, so only the products'
rounding differs (fp32: 2e-5 relative; bf16 tiles: 1.5e-2 relative, the bf16 torch path's own error)."""
from __future__ import annotations

import pytest
import torch

from test_gpu_v4_kernels import D, DEV, H, WINDOW, _fp8, _sources, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fp4(x: torch.Tensor):
    from deepinfer_rt.models.deepseek_v4.common import Fp4Rows

    rows = Fp4Rows.zeros(x.shape[0], x.shape[1], x.device)
    idx = torch.arange(x.shape[0], device=x.device)
    rows.write(idx, x)
    return rows.values, rows.scales, rows.read(idx, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,q_len", [(1, 1), (64, 1), (1, 64)], ids=["decode1", "decode64", "prefill64"])
def test_sparse_mqa_attention_v41_flash_fp4_entries(dtype, batch, q_len):
    from deepinfer_kernels.v4_attention import KeySource, sparse_mqa_attention, sparse_mqa_attention_ref

    gen = torch.Generator(device=DEV).manual_seed(batch * 3 + q_len)
    swa, entries = _sources(batch, q_len, 512, torch.float32, gen)
    spread = torch.linspace(0.05, 8.0, entries.buf.shape[0], device=DEV)[:, None]
    values, scales, deq_entries = _fp4(entries.buf * spread)
    swa_values, swa_scales = _fp8(swa.buf.contiguous())
    sources = [KeySource(swa_values, swa.rows, swa.mask, swa_scales), KeySource(values, entries.rows, None, scales)]
    deq = [KeySource(swa_values.float() * swa_scales, swa.rows, swa.mask), KeySource(deq_entries, entries.rows)]
    q = torch.randn(batch, q_len, H, D, device=DEV, generator=gen).to(dtype)
    sink = torch.randn(H, device=DEV, generator=gen)
    out = sparse_mqa_attention(q, sources, sink, D ** -0.5)
    ref = sparse_mqa_attention_ref(q.float(), deq, sink, D ** -0.5)
    assert torch.equal(sparse_mqa_attention_ref(q.float(), sources, sink, D ** -0.5), ref)
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 1.5e-2)
    fixed = sparse_mqa_attention(q, sources, sink, D ** -0.5, fixed_splits=True)
    assert rel_err(fixed, ref) < (2e-5 if dtype == torch.float32 else 1.5e-2)
    assert WINDOW == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,q_len", [(1, 1), (64, 1), (1, 64)])
def test_index_scores_v41_flash_fp4_keys(dtype, batch, q_len):
    from deepinfer_kernels.v4_indexer import index_scores, index_scores_ref

    heads, di, num_entries = 32, 128, 8192
    gen = torch.Generator(device=DEV).manual_seed(batch + q_len)
    x = torch.randn(batch * num_entries, di, device=DEV, generator=gen)
    values, scales, deq = _fp4(x * torch.rand(x.shape[0], 1, device=DEV, generator=gen).mul(8).add(0.05))
    rows = torch.randperm(x.shape[0], device=DEV, generator=gen).view(batch, num_entries)
    rows[0, -100:] = -1
    q = torch.randn(batch, q_len, heads, di, device=DEV, generator=gen).to(dtype)
    w = torch.randn(batch, q_len, heads, device=DEV, generator=gen)
    visible = torch.rand(batch, q_len, num_entries, device=DEV, generator=gen) < 0.9
    ref = index_scores_ref(q.float(), w, deq, rows, visible, di ** -0.5)
    for fixed in (False, True):
        out = index_scores(q, w, values, rows, visible, di ** -0.5, scales, fixed_order=fixed)
        assert torch.equal(out.isinf(), ref.isinf())
        finite = ref.isfinite()
        assert rel_err(out[finite], ref[finite]) < (2e-5 if dtype == torch.float32 else 1.5e-2)
