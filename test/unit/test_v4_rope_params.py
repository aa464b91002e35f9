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
