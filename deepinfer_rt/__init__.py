"""deepinfer_rt: the in-process runtime (continuous batching, prefix cache, structured output).

Names load on first use, so `deepinfer --version` and `--help` start without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {"Engine": "deepinfer_rt.engine", "GenerateOutput": "deepinfer_rt.request",
            "SamplingParams": "deepinfer_rt.sampling_params", "LLM": "deepinfer_rt.compat.deepinfer"}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from deepinfer_rt.compat.deepinfer import LLM
    from deepinfer_rt.engine import Engine
    from deepinfer_rt.request import GenerateOutput
    from deepinfer_rt.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer_rt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
