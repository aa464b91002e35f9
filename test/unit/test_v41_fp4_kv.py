"""kv_cache_dtype='fp4_e2m1' for the DeepSeek-V4.1 compact pool (models/deepseek_v4/common.py Fp4Rows,
models/deepseek_v4/cache.py): MXFP4 entries and index keys, FP8 sliding keys.

- Fp4Rows stores the experts' MXFP4 format (layers/quant_formats.py quantize_mxfp4, an independent path): the same
  bytes, the same dequantized values; values on the e2m1 grid round-trip exactly; the error is at most the block's
  scale (half the widest e2m1 step, 4 -> 6).
- Bytes per token from the widths: the full V4.1-Flash config's long-lived state is 850 B (4 sources: 340 B per
  entry + index key, at ratio 1 and 2), the recent rows the FP8 layout's; V4 refuses the format.
- The pool's copy_slots copies MXFP4 rows.
- The sparse attention and indexer kernels read MXFP4 rows (interpreted), equal to their torch references within
  the 16-bit kernels' tolerances; the model-level check of the kernel forms on an MXFP4 pool is
  test_v41_topk_reads.py.
"""
from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_rt.layers.quant_formats import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from deepinfer_rt.models.deepseek_v4.cache import V4KVLayout, V4Pool
from deepinfer_rt.models.deepseek_v4.common import Fp4Rows, PoolColumns, fp4_row_bytes

FP4 = "fp4_e2m1"


def test_fp4_rows_match_the_mxfp4_weight_format():
    torch.manual_seed(0)
    x = torch.randn(6, 96) * torch.logspace(-3, 3, 6)[:, None]
    x[2, 32:64] = 0  # an all-zero block
    rows = Fp4Rows.zeros(8, 96, torch.device("cpu"))
    idx = torch.tensor([5, 0, 3, 1, 7, 2])
    rows.write(idx, x)
    packed, scale = quantize_mxfp4(x)
    assert torch.equal(rows.values[idx], packed.view(torch.uint8))
    assert torch.equal(rows.scales[idx], scale.view(torch.uint8))
    got = rows.read(idx, torch.float32)
    assert torch.equal(got, dequantize_mxfp4(packed, scale))
    exp = rows.scales[idx].to(torch.int32) - 127
    s = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp).repeat_interleave(32, dim=1)
    assert ((got - x).abs() <= s).all() and (x[2, 32:64] == got[2, 32:64]).all()
    assert rows.read(idx[None, :2], torch.bfloat16).shape == (1, 2, 96)


def test_fp4_rows_exact_on_the_grid():
    grid = torch.tensor(E2M1_VALUES).repeat(6)[:96]
    x = torch.stack([grid * 2.0 ** e for e in (-5, 0, 7)])
    rows = Fp4Rows.zeros(3, 96, torch.device("cpu"))
    rows.write(torch.arange(3), x)
    assert torch.equal(rows.read(torch.arange(3), torch.float32), x)
    with pytest.raises(ValueError, match="multiple of 16"):
        Fp4Rows.zeros(2, 40, torch.device("cpu"))
    narrow = Fp4Rows.zeros(2, 48, torch.device("cpu"))  # 32 does not divide 48: a scale per 16
    assert narrow.block == 16 and narrow.scales.shape == (2, 3) and fp4_row_bytes(48) == 27
    y = torch.tensor(E2M1_VALUES[:12] * 4).view(1, 48) * torch.tensor([0.25, 8.0, 1.0]).repeat_interleave(16)
    narrow.write(torch.tensor([1]), y)
    assert torch.equal(narrow.read(torch.tensor([1]), torch.float32), y)


def _layout(**kw) -> V4KVLayout:
    # two sources (ratio 1, ratio 2, D = 64, Di = 32), one sliding layer; recent rows [swa | kv, gate]
    return V4KVLayout(3, (1, 192), None, 64, layer_dims=(64, 192, 64), ratios=(1, 2, 0), entry_dims=(96, 96, 0),
                      recent_tokens=7, swa_dim=64, idx_entry_dims=(32, 32, 0), supports_fp4=True, **kw)


def test_fp4_bytes_per_token_from_widths():
    fp4, fp8 = _layout().with_kv_dtype(FP4), _layout().with_kv_dtype("fp8_e4m3")
    per_entry = 64 // 2 + 64 // 32 + 32 // 2 + 32 // 32  # 51: half a byte per value, a scale per 32
    assert fp4.long_lived_bytes_per_token(torch.bfloat16) == per_entry / 1 + per_entry / 2
    assert fp4.recent_bytes_per_token(torch.bfloat16) == fp8.recent_bytes_per_token(torch.bfloat16)
    assert fp4.is_fp8 and fp4.is_fp4 and not fp8.is_fp4
    with pytest.raises(ValueError, match="not supported"):
        dataclasses.replace(_layout(), supports_fp4=False).with_kv_dtype(FP4)
    with pytest.raises(ValueError, match="multiples of 16"):
        V4KVLayout(1, (1, 64), None, 64, layer_dims=(64,), ratios=(1,), entry_dims=(72,), swa_dim=64,
                   idx_entry_dims=(8,), supports_fp4=True).with_kv_dtype(FP4)
    narrow = V4KVLayout(1, (1, 64), None, 64, layer_dims=(64,), ratios=(2,), entry_dims=(80,), swa_dim=64,
                        idx_entry_dims=(16,), supports_fp4=True).with_kv_dtype(FP4)
    assert narrow.long_lived_bytes_per_token(torch.float32) == (32 + 2 + 8 + 1) / 2  # index key: a scale per 16
    with pytest.raises(ValueError, match="must be one of"):
        _layout().with_kv_dtype("fp4")


def test_full_v41_flash_long_lived_bytes_and_v4_refuses():
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "benchmark"), str(root / "scripts")]
    import v4_sweep_shapes as shapes

    report = shapes.full_kv_report()
    v41 = report["v41"]
    assert v41[FP4]["long_lived_bytes_per_token"] == 850.0 <= v41["trtllm_long_range_bytes_per_token"]
    assert v41[FP4]["recent_bytes_per_token"] == v41["fp8_e4m3"]["recent_bytes_per_token"]
    assert v41["fp8_e4m3"]["long_lived_bytes_per_token"] == 1620.0  # unchanged
    kinds = {(k["ratio"], k["entry_bytes"], k["index_key_bytes"]): k["layers"] for k in v41[FP4]["breakdown"]["entries"]}
    assert kinds == {(2, 272, 68): [2, 8, 14], (1, 272, 68): [20]}  # 256 + 16 scales, 64 + 4 scales
    assert v41[FP4]["breakdown"]["recent_sliding_key_bytes"] == 40 * (512 + 4)
    assert v41[FP4]["breakdown"]["recent_other_bytes"] == 3 * 2 * 512 * 2  # a ratio-2 source's kv, gate in bf16
    assert FP4 not in report["v4"] and report["v4"]["fp8_e4m3"]["long_lived_bytes_per_token"] == 3482.6
    import tempfile

    path = shapes.write_model_dir(shapes.raw_config("v4", "bf16", 4, 8, 4096, smoke=True),
                                  Path(tempfile.mkdtemp(prefix="v4-fp4-")))
    with pytest.raises(ValueError, match="fp4_e2m1"):
        shapes.layout_of(path, FP4)


def test_pool_copies_fp4_rows():
    pool = V4Pool(_layout().with_kv_dtype(FP4), 8, 4, torch.float32, torch.device("cpu"))
    assert pool.fp8_entry == [None] * 3 and pool.fp4_entry[2] is None and pool.fp8_swa[2] is not None
    cols = {True: PoolColumns(slice(0, 0), slice(0, 64), slice(64, 128), slice(0, 0), *(slice(0, 0),) * 3)}
    kv = pool.layer_kv(0, cols)
    assert kv.is_fp4 and kv.fp8_entry is None and kv.num_entry_rows == pool.num_slots + 1
    x = torch.randn(2, 64)
    kv.store_entry(torch.tensor([1, 2]), x)
    kv.store_idx_entry(torch.tensor([1, 2]), x[:, :32])
    pool.prepare_decode([[0]], [0])  # main page 0 (slots 0..3) gets its recent rows
    pool.copy_slots([1, 2], [9, 10])
    assert torch.equal(kv.entry(torch.tensor([9, 10])), kv.entry(torch.tensor([1, 2])))
    assert torch.equal(kv.idx_entry(torch.tensor([9, 10])), kv.idx_entry(torch.tensor([1, 2])))
    assert (kv.entry(torch.tensor([1, 2])) - x).abs().max() < x.abs().max() / 2


# MXFP4 key sources and index keys read by the kernels (interpreted) against their torch references, which read
# them through the format's own dequantization (Fp4Rows.read, as V41Method does): rows of widely different
# magnitudes stored by Fp4Rows.write, a scale per 32 and per 16 columns, -1 rows, masks, per-query rows, an MXFP4
# source beside a 16-bit one, split and unsplit; malformed MXFP4 sources are refused.
_FP4_KERNELS = textwrap.dedent("""
    import torch
    from deepinfer_kernels.v4_attention import KeySource, sparse_mqa_attention, sparse_mqa_attention_ref
    from deepinfer_kernels.v4_indexer import index_scores, index_scores_ref
    from deepinfer_rt.models.deepseek_v4.common import Fp4Rows

    def fp4_rows(n, d, g):
        x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g).mul(8).add(0.05)
        rows = Fp4Rows.zeros(n, d, torch.device("cpu"))
        rows.write(torch.arange(n), x)
        return rows, rows.read(torch.arange(n), torch.float32)

    g = torch.Generator().manual_seed(0)
    # fp32: 5e-5 for attention (outputs up to ~40 in magnitude, summed in another order), 1e-5 for the indexer
    for dtype, tol in ((torch.float32, 5e-5), (torch.float16, 2e-3)):
        for G, Q, H, D, L1, L2, per_query, split in [(3, 1, 4, 64, 40, 20, False, None), (1, 5, 4, 48, 37, 9, True, 32)]:
            r1, d1 = fp4_rows(100, D, g)
            q = torch.randn(G, Q, H, D, generator=g).to(dtype)
            rows1 = torch.randint(-1, 100, (G, Q, L1) if per_query else (G, L1), generator=g)
            mask1 = torch.rand(G, Q, L1, generator=g) < 0.7
            rows2 = torch.randint(-1, 60, (G, L2), generator=g)
            plain = torch.randn(60, D, generator=g).to(dtype)
            sink = torch.randn(H, generator=g)
            srcs = [KeySource(r1.values, rows1, mask1, r1.scales), KeySource(plain, rows2)]
            out = sparse_mqa_attention(q, srcs, sink, D ** -0.5, split_len=split)
            ref = sparse_mqa_attention_ref(q, srcs, sink, D ** -0.5)
            assert torch.equal(ref, sparse_mqa_attention_ref(q, [KeySource(d1, rows1, mask1), KeySource(plain, rows2)],
                                                             sink, D ** -0.5))
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            fused = sparse_mqa_attention(q, srcs, sink, D ** -0.5, split_len=128, fuse=True)  # MXFP4 + 16-bit
            torch.testing.assert_close(fused.float(), ref.float(), rtol=tol, atol=tol)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for G, Q, H, Di, E in [(3, 1, 4, 32, 70), (1, 6, 2, 48, 33), (1, 2, 8, 16, 0)]:
            rows, deq = fp4_rows(90, Di, g)
            q = torch.randn(G, Q, H, Di, generator=g).to(dtype)
            w = torch.randn(G, Q, H, generator=g)
            idx = torch.randint(-1, 90, (G, E), generator=g)
            visible = torch.rand(G, Q, E, generator=g) < 0.8
            out = index_scores(q, w, rows.values, idx, visible, Di ** -0.5, rows.scales)
            ref = index_scores_ref(q, w, rows.values, idx, visible, Di ** -0.5, rows.scales)
            assert torch.equal(ref, index_scores_ref(q, w, deq, idx, visible, Di ** -0.5))
            assert torch.equal(out.isinf(), ref.isinf())
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    r, _ = fp4_rows(10, 64, g)
    q = torch.randn(1, 1, 4, 64, generator=g)
    for bad in (KeySource(r.values, torch.zeros(1, 3, dtype=torch.long)),
                KeySource(r.values, torch.zeros(1, 3, dtype=torch.long), scales=r.scales[:, :1]),
                KeySource(r.values[:, :16], torch.zeros(1, 3, dtype=torch.long), scales=r.scales)):
        try:
            sparse_mqa_attention(q, [bad], torch.zeros(4), 0.125)
            raise AssertionError("malformed MXFP4 rows accepted")
        except ValueError:
            pass
    print("ok")
""")


def test_kernels_read_fp4_rows_interpreted():
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_triton_interpreted import _interpret

    assert _interpret(_FP4_KERNELS).strip().endswith("ok")
