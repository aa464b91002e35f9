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
    """A callable(token_ids, sampling_params) raising ValueError for requests the model refuses."""
    if config.architecture == "DeepseekV41ForCausalLM":
        from deepinfer_rt.env import get_env
        from deepinfer_rt.models.deepseek_v41.config import V41Config

        cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
        truncating = get_env().v41_yoco_truncation

        def check(token_ids, params) -> None:
            cfg.check_prompt(token_ids)
            if truncating and params.prompt_logprobs:
                raise ValueError("prompt_logprobs: not available with DEEPINFER_V41_YOCO_TRUNCATION=1 (the YOCO "
                                 "consumer layers skip all but the last window of prompt rows)")

        return check
    return lambda token_ids, params: None
