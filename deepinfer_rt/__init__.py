"""deepinfer_rt: the in-process runtime (continuous batching, prefix cache, structured output).

Names load on first use, so `deepinfer --version` and `--help` start without importing torch.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from typing import TYPE_CHECKING

_EXPORTS = {"Engine": "deepinfer_rt.engine", "GenerateOutput": "deepinfer_rt.request",
            "SamplingParams": "deepinfer_rt.sampling_params", "LLM": "deepinfer_rt.compat.deepinfer"}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from deepinfer_rt.compat.deepinfer import LLM
    from deepinfer_rt.engine import Engine
    from deepinfer_rt.request import GenerateOutput
    from deepinfer_rt.sampling_params import SamplingParams


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _InstalledKernelsFinder:
    """In a source checkout the folder kernels/ (our deepinfer_kernels) sits at the root, so wherever the root is
    on sys.path (`python -m ...` run from it puts it first) it shadows PyPI's `kernels`, which transformers >= 5.25
    requires and imports. This finder resolves the name `kernels` over sys.path without the checkout's root; where
    no installed `kernels` exists it steps aside and the usual finders run."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "kernels" or path is not None:
            return None
        search = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _ROOT]
        return importlib.machinery.PathFinder.find_spec(name, search)


if os.path.isfile(os.path.join(_ROOT, "kernels", "__init__.py")) and not any(
        isinstance(f, type) and f.__name__ == _InstalledKernelsFinder.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _InstalledKernelsFinder)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer_rt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
