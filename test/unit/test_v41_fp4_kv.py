"""kv_cache_dtype='fp4_e2m1' for the DeepSeek-V4.1 compact pool (models/deepseek_v4/common.py Fp4Rows,
models/deepseek_v4/cache.py): MXFP4 entries and index keys, FP8 sliding keys.

- Fp4Rows stores the experts' MXFP4 format (layers/quant_formats.py quantize_mxfp4, an independent path): the same
  bytes, the same dequantized values; values on the e2m1 grid round-trip exactly; the error is at most the block's
  scale (half the widest e2m1 step, 4 -> 6).
- Bytes per token from the widths: the full V4.1-Flash config's long-lived state is 850 B (4 sources: 340 B per
  entry + index key, at ratio 1 and 2), the recent rows the FP8 layout's; V4 refuses the format.
- The pool's copy_slots copies MXFP4 rows; the Triton kernel forms refuse an MXFP4 source (no silent conversion).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_rt.layers.quant_formats import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from deepinfer_rt.models.deepseek_v4.cache import V4KVLayout, V4Pool
from deepinfer_rt.models.deepseek_v4.common import Fp4Rows, LayerKV, PoolColumns, fp4_row_bytes

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


def test_kernel_forms_refuse_fp4_sources():
    pytest.importorskip("triton")
    from deepinfer_rt.models.deepseek_v4.methods import V4Method
    from deepinfer_rt.models.deepseek_v41 import methods

    pool = V4Pool(_layout().with_kv_dtype(FP4), 8, 4, torch.float32, torch.device("cpu"))
    cols = {True: PoolColumns(*(slice(0, 0),) * 7)}
    src = pool.layer_kv(0, cols)
    forms = methods.V41TritonMethod.__new__(methods.V41TritonMethod)  # no kernels are reached
    with pytest.raises(ValueError, match="fp4_e2m1.*not read by the V4.1 Triton kernels"):
        forms.index_scores(torch.zeros(1, 1, 2, 32), src, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 1, 2))
    with pytest.raises(ValueError, match="fp4_e2m1"):
        forms.attend(torch.zeros(1, 2, 64), None, 1, src, src, None, None)
    assert not LayerKV(torch.zeros(1, 1), torch.zeros(1, 1), cols[True]).is_fp4
