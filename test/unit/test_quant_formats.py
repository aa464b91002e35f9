"""The V4-family quantized layouts (layers/quant_formats.py): e8m0 and e2m1 codecs, MXFP4 and FP8-e8m0 round
trips, the per-role layout checks, the Engram lookup, V4.1 per-tensor quantization, and QuantConfig detection."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_rt.config import QuantConfig
from deepinfer_rt.layers import quant_formats as qf
from deepinfer_rt.models.release_names import from_release_name


def test_e8m0_decodes_bytes_dtype_and_float_powers_of_two():
    raw = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    want = torch.tensor([2.0 ** (b - 127) for b in raw.tolist()])
    assert torch.equal(qf.decode_e8m0(raw), want)
    assert torch.equal(qf.decode_e8m0(raw.view(torch.float8_e8m0fnu)), want)
    assert torch.equal(qf.decode_e8m0(want), want)
    assert torch.equal(qf.encode_e8m0(want).view(torch.uint8), raw)
    with pytest.raises(ValueError, match="NaN"):
        qf.decode_e8m0(torch.tensor([255], dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a positive power of two"):
        qf.decode_e8m0(torch.tensor([0.3]))
    with pytest.raises(ValueError, match="not an e8m0 scale"):
        qf.decode_e8m0(torch.tensor([1], dtype=torch.int32))


def test_read_scale_refuses_raw_bytes_without_ue8m0():
    raw = torch.tensor([127], dtype=torch.uint8)
    assert qf.read_scale(raw, "ue8m0").item() == 1.0
    with pytest.raises(ValueError, match="scale_fmt is float32"):
        qf.read_scale(raw, "float32")
    assert qf.read_scale(torch.tensor([0.3]), "float32").item() == pytest.approx(0.3)


def test_e2m1_table_and_nibble_order():
    codes = torch.arange(16)
    packed = qf.pack_e2m1(codes)
    assert packed.dtype == torch.int8 and packed.view(torch.uint8).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA,
                                                                                 0xDC, 0xFE]
    assert qf.unpack_e2m1(packed).tolist() == list(qf.E2M1_VALUES)
    got = qf.e2m1_codes(torch.tensor(qf.E2M1_VALUES))
    assert got[8] == 0 and torch.equal(got[codes != 8], codes[codes != 8])  # -0.0 is written as +0


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(-20, 20), st.integers(0, 2**31 - 1))
def test_mxfp4_round_trip_exact_on_the_grid(rows, groups, exp, seed):
    """Values already e2m1 x a power of two per 32 come back exactly; the scale is the one that makes the
    group's amax 6 (or less, with no clipping)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 32 * groups), generator=gen)
    codes[:, ::32] = 7  # every group holds a 6 at its first element
    scale = 2.0 ** torch.randint(exp - 3, exp + 3, (rows, groups), generator=gen).float()
    w = torch.tensor(qf.E2M1_VALUES)[codes] * scale.repeat_interleave(32, dim=1)
    packed, s = qf.quantize_mxfp4(w)
    assert packed.shape == (rows, 16 * groups) and s.shape == (rows, groups) and s.dtype == torch.float8_e8m0fnu
    assert torch.equal(qf.decode_e8m0(s), scale)
    assert torch.equal(qf.dequantize_mxfp4(packed, s), w)


def test_mxfp4_error_is_bounded_by_half_a_step():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    back = qf.dequantize_mxfp4(*qf.quantize_mxfp4(w))
    scale = qf.decode_e8m0(qf.quantize_mxfp4(w)[1]).repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= scale * 1.0 + 1e-7).all()  # the widest e2m1 step is 2 (4 -> 6)
    assert ((back - w).abs() / w.abs().clamp(min=1e-3)).median() < 0.15
    with pytest.raises(ValueError, match="multiple of 32"):
        qf.quantize_mxfp4(torch.zeros(2, 48))


def _e4m3_tolerance(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Half a step of e4m3 at each value: 2^-4 relative for normals, 2^-10 x the block scale for subnormals."""
    from deepinfer_kernels.reference import expand_block_scales

    return w.abs() * 2**-4 + expand_block_scales(qf.decode_e8m0(scale), tuple(w.shape), block) * 2**-10


def test_fp8_e8m0_blocks_round_trip_and_edge_blocks():
    w = torch.randn(160, 192, generator=torch.Generator().manual_seed(1))
    q, s = qf.quantize_fp8_e8m0(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    back = qf.dequantize_fp8_e8m0(q, s, (128, 128))
    assert ((back - w).abs() <= _e4m3_tolerance(w, s, (128, 128))).all()
    tiles = torch.nn.functional.pad(w, (0, 64, 0, 96)).view(2, 128, 2, 128).abs().amax(dim=(1, 3))
    scale = qf.decode_e8m0(s)
    assert (tiles / scale <= 448).all() and (tiles / scale > 224).all()  # the smallest power of two that fits


def test_layout_check_names_the_tensor_and_the_packing():
    lay = qf.role_layouts((32, 32), "fp4")
    assert lay[qf.EXPERT].stored_block == (1, 16) and lay[qf.EXPERT].element_block == (1, 32)
    qf.check_layout("w", lay[qf.EXPERT], torch.zeros(4, 32, dtype=torch.int8), (4, 2), (4, 64))
    with pytest.raises(ValueError, match=r"layers.0.ffn.experts.0.w1: scale shape \(4, 4\) != \(4, 2\).*1x16-element "
                                         r"blocks \(1x8 on disk.*wants 32 elements = 16 bytes"):
        qf.check_layout("layers.0.ffn.experts.0.w1", lay[qf.EXPERT], None, (4, 4), (4, 64))
    with pytest.raises(ValueError, match=r"bfloat16 where the checkpoint's dense weights are float8_e4m3fn"):
        qf.check_layout("x", lay[qf.DENSE], torch.zeros(4, 4, dtype=torch.bfloat16), (1, 1), (4, 4))
    with pytest.raises(ValueError, match="expert_dtype 'nvfp4'"):
        qf.role_layouts((32, 32), "nvfp4")


def test_engram_lookup_decodes_only_the_rows_asked():
    table = torch.randn(11, 64, generator=torch.Generator().manual_seed(2))
    q, s = qf.quantize_engram_table(table)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (11, 2) and s.dtype == torch.float8_e8m0fnu
    rows = torch.tensor([[3, 0], [10, 3]])
    got = qf.engram_lookup(q, s, rows, torch.float32)
    full = qf.dequantize_fp8_e8m0(q, s, (1, 32))
    assert got.shape == (2, 2, 64) and torch.equal(got, full[rows])
    assert ((full - table).abs() <= _e4m3_tolerance(table, s, (1, 32))).all()
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, 11\)"):
        qf.engram_lookup(q, s, torch.tensor([11]))
    with pytest.raises(ValueError, match=r"engram table: scale shape \(11, 4\) != \(11, 2\)"):
        qf.engram_lookup(q, torch.cat([s, s], dim=1), rows)


def test_v41_tensors_round_trip_per_role():
    from quantize_checkpoint import dequantize_release_tensors, quantize_v41_tensor, release_role

    gen = torch.Generator().manual_seed(3)
    src = {"model.layers.0.attn.wq_a.weight": torch.randn(96, 64, generator=gen),
           "model.layers.0.ffn.experts.1.w2.weight": torch.randn(64, 96, generator=gen),
           "model.layers.1.engram.embed.weight": torch.randn(13, 64, generator=gen),
           "model.layers.0.attn_norm.weight": torch.randn(64, generator=gen)}
    out = dict(kv for name, t in src.items() for kv in quantize_v41_tensor(name, t))
    assert out["layers.0.attn.wq_a.scale"].shape == (3, 2)  # 32 x 32 blocks
    assert out["layers.0.ffn.experts.1.w2.weight"].dtype == torch.int8
    assert out["layers.0.ffn.experts.1.w2.scale"].shape == (64, 3)
    assert out["layers.1.engram.embed.scale"].shape == (13, 2)
    assert out["layers.0.attn_norm.weight"].dtype == torch.float32
    assert [release_role(n) for n in ("layers.0.attn.wq_a.weight", "layers.0.ffn.experts.1.w2.weight",
                                      "layers.1.engram.embed.weight", "layers.0.ffn.gate.weight")] == \
        [qf.DENSE, qf.EXPERT, qf.ENGRAM, None]
    back = dequantize_release_tensors(out, (32, 32))
    assert back.keys() == src.keys()
    for name, w in src.items():
        tol = 0.5 if ".experts." in name else 2**-3  # e2m1 vs e4m3, relative to the group's scale / the value
        err = (back[name] - w).abs()
        assert (err <= tol * w.abs().max()).all(), name


def test_release_names():
    assert from_release_name("layers.2.ffn.experts.5.w3.scale") == "model.layers.2.ffn.experts.5.w3.weight_scale_inv"
    assert from_release_name("layers.2.attn.wo_a.scale") == "model.layers.2.attn.wo_a.weight_scale_inv"
    assert from_release_name("layers.2.hc_ffn_scale") == "model.layers.2.hc_ffn_scale"
    assert from_release_name("hc_head_scale") == "model.hc_head.hc_scale"
    assert from_release_name("embed.weight") == "model.embed_tokens.weight"
    assert from_release_name("model.layers.0.attn.wq_a.weight") == "model.layers.0.attn.wq_a.weight"


V4 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
      "weight_block_size": [128, 128]}


def test_quant_config_detects_the_release_formats():
    v3 = QuantConfig.from_hf({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    assert v3 == QuantConfig("fp8", (128, 128), "float32", "fp8") and v3.format == "v3-fp8"
    v4 = QuantConfig.from_hf(V4, expert_dtype="fp4")  # V4 ships expert_dtype at the config's top level
    assert v4 == QuantConfig("fp8", (128, 128), "ue8m0", "fp4") and v4.format == "v4"
    v41 = QuantConfig.from_hf({**V4, "weight_block_size": [32, 32], "expert_dtype": "fp4"})
    assert v41.format == "v41" and v41.weight_block_size == (32, 32)
    assert QuantConfig.from_hf(V4).format == "fp8-ue8m0"  # V3.1-style: power-of-two scales, FP8 experts
    with pytest.raises(ValueError, match="scale_fmt 'e4m3'"):
        QuantConfig.from_hf({**V4, "scale_fmt": "e4m3"})
    with pytest.raises(ValueError, match="expert_dtype 'nvfp4'"):
        QuantConfig.from_hf({**V4, "expert_dtype": "nvfp4"})
