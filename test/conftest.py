"""Shared fixtures: the embedded SmolLM2 folder, tiny random checkpoints, engines and HF references."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import deepinfer_rt  # noqa: F401  (first: in the checkout its finder keeps kernels/ from shadowing PyPI's `kernels`)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from deepinfer_rt.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    from deepinfer_rt import Engine

    with Engine(str(smollm2_path), dtype="float32", kv_cache_tokens=32768) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_v3_path(tmp_path_factory) -> Path:
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tiny-v3"), seed=0)


@pytest.fixture(scope="session")
def tiny_v4_path(tmp_path_factory) -> Path:
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("tiny-v4"), seed=0)


@pytest.fixture(scope="session")
def tiny_v4_hc4_path(tmp_path_factory) -> Path:
    """DeepSeek-V4 with 4 hyper-connection streams, a YaRN compress rope and another layer order."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(
        "deepseek_v4", tmp_path_factory.mktemp("tiny-v4-hc4"), seed=1, hc_mult=4,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"])


@pytest.fixture(scope="session")
def tiny_v41_paths(tmp_path_factory) -> dict[str, Path]:
    """The two tiny DeepSeek-V4.1 configs (scripts/tiny_deepseek_v41.py TINY_CONFIGS): 'a' with HF names, 'b' with
    the release's names and inference/config.json."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return {"a": make_tiny_checkpoint("deepseek_v41", tmp_path_factory.mktemp("tiny-v41a"), seed=0, variant="a"),
            "b": make_tiny_checkpoint("deepseek_v41", tmp_path_factory.mktemp("tiny-v41b"), seed=1, variant="b",
                                      names="release")}


@pytest.fixture(scope="session")
def v41_oracles(tiny_v41_paths):
    """variant -> the plain reference forward (test/reference/deepseek_v41_ref.py) on that checkpoint's weights."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "test" / "reference"))
    from deepseek_v41_ref import V41Reference

    out, texts, raw = {}, None, None
    for variant, path in tiny_v41_paths.items():
        text = json.loads((path / "config.json").read_text())["text_config"]
        weights = load_file(path / "model.safetensors")
        if "head.weight" in weights and "embed.weight" in weights:  # release names
            weights = {k if k == "head.weight" else "model." + ("embed_tokens.weight" if k == "embed.weight" else k): v
                       for k, v in weights.items()}
        if texts is None:  # both checkpoints carry the same tokenizer
            tok = AutoTokenizer.from_pretrained(path)
            texts = tok.batch_decode([[i] for i in range(text["vocab_size"])])
            raw = tok.convert_ids_to_tokens(list(range(text["vocab_size"])))
        out[variant] = V41Reference(text, weights, texts, raw_tokens=raw)
    return out


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread while a module runs (many tiny ops: thread hand-offs dominate on a shared 2-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def dspark_v41_path(tmp_path_factory) -> Path:
    """Tiny DeepSeek-V4.1 config 'a' with DSpark drafter weights (scripts/tiny_deepseek_v41.py DSPARK)."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v41", tmp_path_factory.mktemp("tiny-v41-dspark"), seed=0, variant="a",
                                dspark=True)
