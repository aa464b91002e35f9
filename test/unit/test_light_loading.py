"""Start-up without transformers' model stack: a plain Llama config.json is read as it is (plain_llama_config) and a
tokenizer_config.json naming the plain tokenizer.json wrapper is loaded by that class, each equal to what
AutoConfig / AutoTokenizer give; anything else still goes through them."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from transformers import AutoConfig, AutoTokenizer

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.models.loader import load_model_config, plain_llama_config
from deepinfer_rt.tokenizer import load_tokenizer

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _fields(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, raw=None)


def _write(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("change", [{}, {"tie_word_embeddings": False}, {"eos_token_id": [2, 7]},
                                    {"head_dim": 32, "num_key_value_heads": 9}, {"attention_bias": True},
                                    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}])
def test_plain_llama_config_equals_autoconfig(smollm2_path, tmp_path, change):
    raw = {**json.loads((smollm2_path / "config.json").read_text()), **change}
    path = _write(tmp_path, raw)
    plain = plain_llama_config(raw)
    assert plain is not None
    config, hf = load_model_config(path)
    assert hf is not None and type(hf).__name__ == "_FileConfig"
    assert _fields(config) == _fields(ModelConfig.from_hf(AutoConfig.from_pretrained(path)))
    assert config.raw == raw


@pytest.mark.parametrize("change", [{"max_position_embeddings": None}, {"rms_norm_eps": None},
                                    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}},
                                    {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}])
def test_other_configs_go_through_autoconfig(smollm2_path, tmp_path, change):
    raw = {k: v for k, v in {**json.loads((smollm2_path / "config.json").read_text()), **change}.items()
           if v is not None}
    assert plain_llama_config(raw) is None
    path = _write(tmp_path, raw)
    config, hf = load_model_config(path)
    assert type(hf).__name__ != "_FileConfig"
    assert _fields(config) == _fields(ModelConfig.from_hf(AutoConfig.from_pretrained(path)))


def test_backend_tokenizer_equals_autotokenizer(smollm2_path):
    ours, auto = load_tokenizer(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)
    assert type(ours) is type(auto)
    text = "Hello <|im_start|> wörld\n\n  tabs\tand émoji 🙂, 12345"
    assert ours.encode(text) == auto.encode(text)
    assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, ours.all_special_ids) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id, auto.all_special_ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_engine_start_skips_the_model_stack(tiny_llama_path):
    """The point of both: an engine on a plain Llama folder never imports transformers' Llama configuration
    module (which pulls in torch.distributed.tensor through transformers' model loading)."""
    code = ("import sys; from deepinfer_rt import Engine\n"
            f"e = Engine({str(tiny_llama_path)!r}, dtype='float32', kv_cache_tokens=256)\n"
            "print(sorted(m for m in ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor')"
            " if m in sys.modules)); e.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
