"""Model resolution and loading: dummy weights, hub ids offline, unsupported architectures, the CLI."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.cli import main as cli_main


def test_dummy_weights_from_config_alone(tiny_v3_path, tmp_path):
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_v3_path / f, tmp_path / f)
    with Engine(str(tmp_path), dtype="float32", load_format="dummy", kv_cache_tokens=512, seed=3) as e:
        out = e.generate(["hello"], sampling_params=SamplingParams(max_new_tokens=4, temperature=0,
                                                                   ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        w = e.model.model.layers[0].self_attn.kv_b_proj.weight
        assert 0.01 < w.float().std().item() < 0.05  # random, not zeros or the checkpoint's spread


def test_hub_id_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not be fetched"):
        Engine("no-such-org/no-such-model")


def test_unsupported_architecture(tiny_llama_path, tmp_path):
    for f in tiny_llama_path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        Engine(str(tmp_path))


def test_bfloat16_runs(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="bfloat16", kv_cache_tokens=256) as e:
        assert e.model.lm_head.weight.dtype == torch.bfloat16 and e.pool.k[0].dtype == torch.bfloat16
        out = e.generate(["hi there"], sampling_params=SamplingParams(max_new_tokens=3, temperature=0,
                                                                      ignore_eos=True))[0]
        assert len(out.token_ids) == 3


def test_cli_generate(tiny_llama_path, capsys):
    assert cli_main(["generate", "hello", "world", "--model", str(tiny_llama_path), "--max-new-tokens", "3",
                     "--json", "--dtype", "float32"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2 and all(x["completion_tokens"] <= 3 for x in lines)


def test_dummy_weights_cast_as_built(tiny_llama_path, tiny_v4_path, monkeypatch):
    """Dummy models cast their linears and experts to the model dtype as each is built (loader._cast_as_built): the
    same weights, dtypes included (DeepSeek-V4 keeps its fp32 norms and mixing weights), as casting the built model."""
    import contextlib

    from deepinfer_rt.layers.linear import Linear
    from deepinfer_rt.layers.norm import RMSNorm
    from deepinfer_rt.models import loader

    with loader._cast_as_built(torch.bfloat16):
        block = torch.nn.Sequential(Linear(8, 4), RMSNorm(8, 1e-6))
    assert block[0].weight.dtype == torch.bfloat16 and block[1].weight.dtype == torch.float32

    def states():
        with Engine(str(path), dtype="bfloat16", load_format="dummy", kv_cache_tokens=256) as engine:
            return {k: v.clone() for k, v in engine.model.state_dict().items()}

    for path in (tiny_llama_path, tiny_v4_path):
        cast = states()
        with monkeypatch.context() as m:
            m.setattr(loader, "_cast_as_built", lambda dtype: contextlib.nullcontext())
            whole = states()
        assert cast.keys() == whole.keys()
        for k in cast:
            assert cast[k].dtype == whole[k].dtype and torch.equal(cast[k], whole[k]), k
        assert any(v.dtype == torch.float32 for v in cast.values()) == (path == tiny_v4_path)
