"""Model classes by HF `architectures[0]`."""
from __future__ import annotations

import importlib

from deepinfer_rt.models.base import CausalLM

_MODELS = {
    "LlamaForCausalLM": ("deepinfer_rt.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("deepinfer_rt.models.llama", "LlamaForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepinfer_rt.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepinfer_rt.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("deepinfer_rt.models.deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "DeepseekV41ForCausalLM": ("deepinfer_rt.models.deepseek_v41.model", "DeepseekV41ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported_architectures()}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)


def prompt_checker(config):
    """A callable(token_ids) raising ValueError for prompts the model refuses (ModelConfig -> checker)."""
    if config.architecture == "DeepseekV41ForCausalLM":
        from deepinfer_rt.models.deepseek_v41.config import V41Config

        return V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"}).check_prompt
    return lambda token_ids: None
