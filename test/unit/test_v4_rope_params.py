"""parse_rope (models/deepseek_v4/common.py): the one reading of the V4 family's RoPE / YaRN fields, from
transformers' nested rope_parameters (V4) or from the raw rope_scaling and thetas (V4.1)."""
from __future__ import annotations

import pytest

from deepinfer_rt.models.deepseek_v4.common import parse_rope

RAW = {"qk_rope_head_dim": 8, "rope_theta": 1000, "compress_rope_theta": 5000,
       "rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                        "original_max_position_embeddings": 256}}


def test_raw_fields_become_the_main_and_compress_sets():
    rope_dim, main, compress = parse_rope(RAW, 16, 8, "V4.1")
    assert rope_dim == 8 and main == {"rope_type": "default", "rope_theta": 1000.0}
    assert compress == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": 256, "rope_theta": 5000.0}
    assert all(isinstance(compress[k], float) for k in ("factor", "beta_fast", "beta_slow", "rope_theta"))


def test_defaults_are_the_releases_yarn_and_thetas():
    _, main, compress = parse_rope({"qk_rope_head_dim": 8}, 16, 8, "V4.1")
    assert main == {"rope_type": "default", "rope_theta": 10000.0}
    assert compress == {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": 65536, "rope_theta": 160000.0}


def test_nested_parameters_are_taken_as_they_are():
    nested = {"main": {"rope_type": "default", "rope_theta": 7.0},
              "compress": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.0, "rope_theta": 9.0}}
    _, main, compress = parse_rope({**RAW, "rope_parameters": nested}, 16, 8, "V4")
    assert (main, compress) == (nested["main"], nested["compress"])
    assert main is not nested["main"] and compress is not nested["compress"]  # copies


@pytest.mark.parametrize("change, message", [
    ({"qk_rope_head_dim": 7}, "must be even"),
    ({"qk_rope_head_dim": 10}, "fit head_dim"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "must be 'yarn'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale_all_dim": 0.7}}, "mscale_all_dim is not supported for V4.1"),
])
def test_bad_fields_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        parse_rope({**RAW, **change}, 16, 8, "V4.1")


def test_rotary_tables_shared_within_one_forward_pass_only():
    """Inside step_cache a positions tensor's tables are computed once (the later layers reuse them); an in-place
    change of the positions, or a call outside the pass, computes them anew, and the values never differ."""
    import torch

    from deepinfer_rt.models.deepseek_v4.common import V4Rotary, shared_tables

    rotary = object.__new__(V4Rotary)  # the tables' arithmetic only: frequencies and scale set directly
    rotary.inv_freq, rotary.scale, rotary._cache = 1.0 / 100 ** (torch.arange(0, 8, 2) / 8), 1.5, None
    positions = torch.arange(5)
    want = rotary.cos_sin(positions)
    with shared_tables([rotary]):
        first = rotary.cos_sin(positions)
        again = rotary.cos_sin(positions)
        assert again[0] is first[0] and again[1] is first[1]
        other = rotary.cos_sin(positions + 0)  # another tensor of the same values: its own entry
        assert other[0] is not first[0] and torch.equal(other[0], first[0])
        positions.add_(3)  # in place: the cached tables are stale
        moved = rotary.cos_sin(positions)
        assert moved[0] is not first[0] and torch.equal(moved[0], rotary.cos_sin(torch.arange(3, 8))[0])
    positions.sub_(3)
    assert rotary.cos_sin(positions)[0] is not first[0]  # no sharing outside the pass
    assert torch.equal(first[0], want[0]) and torch.equal(first[1], want[1])
    with torch.inference_mode(), shared_tables([rotary]):  # no version counter: computed each time, no error
        frozen = torch.arange(5)
        assert rotary.cos_sin(frozen)[0] is not rotary.cos_sin(frozen)[0]
        assert torch.equal(rotary.cos_sin(frozen)[0], want[0])
