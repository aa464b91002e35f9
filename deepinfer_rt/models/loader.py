"""Resolve a model name to an HF folder, build the model from its config, load safetensors by name."""
from __future__ import annotations

import contextlib

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.registry import get_model_class
from deepinfer_rt.models.smollm2 import NAME as SMOLLM2, ensure_smollm2


def resolve_model_path(model: str) -> Path:
    if model == SMOLLM2:
        return ensure_smollm2()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if model.count("/") == 1 and not path.exists():
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                  "*.jinja", "*.txt"]))
        except Exception as e:  # offline and not cached, unknown repo, ...
            raise ValueError(f"model {model!r} is not a local folder and could not be fetched from the hub "
                             f"(offline and not in the local cache?): {e}") from e
    raise ValueError(f"model {model!r} is neither {SMOLLM2!r}, a folder with config.json, nor a hub id")


_PLAIN_LLAMA_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "eos_token_id",
                       "bos_token_id", "tie_word_embeddings", "hidden_act", "attention_bias")
"""What ModelConfig.from_hf reads of a Llama config; a file that states all of them needs none of transformers'
defaults."""


class _FileConfig:
    """A config.json read as attributes, as ModelConfig.from_hf reads transformers' config objects."""

    def __init__(self, raw: dict):
        self.__dict__.update(raw)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def plain_llama_config(raw: dict) -> _FileConfig | None:
    """config.json as it is, for a plain Llama (unquantized, unscaled rotary) whose file states every field
    ModelConfig.from_hf reads; else None (transformers' AutoConfig fills what the file leaves out). Importing
    transformers' Llama configuration module pulls in its model-loading stack: about a second and a half of the
    embedded default's start-up on two cores, for values already in the file."""
    rope = raw.get("rope_parameters") or {}
    if (raw.get("model_type") != "llama" or raw.get("architectures") != ["LlamaForCausalLM"]
            or "quantization_config" in raw or raw.get("rope_scaling") is not None
            or set(rope) - {"rope_theta", "rope_type"} or rope.get("rope_type", "default") != "default"
            or "rope_theta" not in rope or not all(raw.get(f) is not None for f in _PLAIN_LLAMA_FIELDS)):
        return None
    return _FileConfig(raw)


def load_model_config(path: Path) -> tuple[ModelConfig, object]:
    from deepinfer_rt.models.deepseek_v41.config import is_v41_config, read_config_file, v41_model_config

    raw = read_config_file(path)
    if is_v41_config(raw):  # transformers has no DeepSeek-V4.1 classes
        return v41_model_config(raw, path), raw
    plain = plain_llama_config(raw)
    if plain is not None:
        return ModelConfig.from_hf(plain), plain
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    config = ModelConfig.from_hf(hf)
    return _with_detected_expert_dtype(config, path), hf


_EXPERT_WEIGHT = re.compile(r".*\.experts\.(\d+\.(w[123]|gate_proj|up_proj|down_proj)\.weight|gate_up_proj|down_proj)")


def _with_detected_expert_dtype(config: ModelConfig, path: Path) -> ModelConfig:
    """A quantized checkpoint whose config does not say `expert_dtype`: MXFP4 ('fp4') if its routed experts are
    stored as int8/uint8 (packed e2m1), read from the safetensors headers; else the config as it is."""
    q = config.quantization
    declared = config.raw.get("expert_dtype") or (config.raw.get("quantization_config") or {}).get("expert_dtype")
    if q is None or declared:
        return config
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if _EXPERT_WEIGHT.fullmatch(name):
                    packed = sf.get_slice(name).get_dtype() in ("I8", "U8")
                    if not packed:
                        return config
                    return dataclasses.replace(config, quantization=dataclasses.replace(q, expert_dtype="fp4"))
    return config


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path}")
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "orthogonal_")
"""The random draws; the constant fills (zeros_, ones_) stay, a constructor may mean them."""


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Modules built without torch.nn.init's random draws (nn.Linear, nn.Embedding): every parameter drawn is then
    loaded from the checkpoint or drawn by init_dummy (load_weights refuses a checkpoint that lacks one), so the
    draws were wasted; for the embedded default they were a second of start-up on two cores."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def is_cast_as_built(module: torch.nn.Module | None) -> bool:
    """Whether a dummy build casts this module to the model dtype as soon as it is built (_cast_as_built)."""
    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or getattr(module, "cast_as_built", False)


@contextlib.contextmanager
def _cast_as_built(dtype: torch.dtype | None) -> Iterator[None]:
    """The bulk of the weights cast to `dtype` as each holder joins its parent (linears, embeddings, and modules of
    routed experts, `cast_as_built`; module.to(dtype), so a holder that keeps FP8 values keeps them), so a dummy
    model built where it runs never holds more than one such module's parameters in fp32: DeepSeek-V3's 61 layers
    in fp32 are 2.7 TB, one layer's 256 experts 42 GB. Other modules wait for the built model's cast, where a model
    keeps some of them in fp32 by name (DeepSeek-V4's norms, sinks and mixing weights; the routers' fp32 weights).
    The values are those of casting the built model: init_dummy draws in fp32 and rounds as it copies."""
    if dtype is None:
        yield
        return

    def cast(module, name, submodule):
        return submodule.to(dtype) if is_cast_as_built(submodule) else None

    handle = torch.nn.modules.module.register_module_module_registration_hook(cast)
    try:
        yield
    finally:
        handle.remove()


class Shard(Protocol):
    """Cuts a freshly built model down to one rank's part (expert parallelism: distributed/ep.py ExpertShard)."""

    def __call__(self, model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
        """Called after construction, before weights are loaded or drawn; the kept tensors go to device/dtype."""

    def init_dummy(self, model: CausalLM, seed: int) -> None:
        """load_format='dummy' for the sharded model, in place of `model.init_dummy`."""


def build_model(config: ModelConfig, path: Path | None, load_format: str, dtype: torch.dtype,
                device: torch.device, seed: int, shard: Shard | None = None,
                kernel_config: KernelConfig | None = None) -> CausalLM:
    """The model with its weights, on `device`, its layers' methods chosen from `kernel_config` (default: for
    `device`, not batch-invariant, the other knobs from the environment) and the checkpoint's quantization
    (KernelConfig.for_checkpoint); `shard` (an EP rank) keeps its part."""
    cls = get_model_class(config.architecture)
    if kernel_config is None:
        kernel_config = KernelConfig.from_env(device)
    kernel_config = kernel_config.for_checkpoint(config.quantization)
    dummy = load_format == "dummy"
    # Dummy weights are drawn where the model runs: a 16B-parameter model initialises in seconds on a GPU.
    # A model to shard is built on the CPU, where its full-size expert tensors (torch.empty) are only reserved.
    with torch.device(device if dummy and shard is None else "cpu"), build_context(kernel_config), _no_init(), \
            _cast_as_built(dtype if dummy and shard is None else None):
        model = cls(config)
    if shard is not None:
        shard(model, *((device, dtype) if dummy else (torch.device("cpu"), torch.get_default_dtype())))
    if dummy and shard is not None:
        model = model.to(device=device, dtype=dtype)
        shard.init_dummy(model, seed)
    elif dummy:
        model.init_dummy(seed)
    elif load_format in ("auto", "safetensors"):
        assert path is not None
        model.load_weights(iter_safetensors(path))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    model.tie_weights()
    return finalize(model.to(device=device, dtype=dtype).eval())


def finalize(model: torch.nn.Module) -> torch.nn.Module:
    """Weight rearrangements for the device's fast paths, once the weights are final and in place: each module's
    `process_weights_after_loading` (e.g. FP8 weights dequantized or laid out for the GEMM, MoE's shared experts
    joined to the routed ones on GPU), a module's after those of the modules it holds (MLA's padded kv_b and the
    joined experts read their parts' final weights)."""
    for module in reversed(list(model.modules())):  # reversed pre-order: every module after its descendants
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()  # what the rearrangements freed must not count as used when sizing the KV pool
    return model
