"""Every DEEPINFER_* environment variable, typed, in one place.

Read through the accessors below (never os.environ elsewhere), so a variable is documented where declared.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


def _str(name: str, default: str) -> str:
    value = os.environ.get(name)
    return default if value in (None, "") else value


@dataclass(frozen=True)
class Env:
    cache_dir: Path
    """DEEPINFER_CACHE: where converted models (the embedded default) are kept. Default ~/.cache/deepinfer."""
    batch_invariant: bool
    """DEEPINFER_BATCH_INVARIANT=1: batch-invariant numerics (outputs independent of batch composition)."""
    log_level: str
    """DEEPINFER_LOG_LEVEL: logging level of the deepinfer loggers (default WARNING)."""
    kv_cache_memory_fraction: float
    """DEEPINFER_KV_CACHE_MEMORY_FRACTION: share of free memory given to the KV pool when its size is not set."""
    kv_cache_max_cpu_gib: float
    """DEEPINFER_KV_CACHE_MAX_CPU_GIB: upper bound of the KV pool on CPU when sized from memory (GiB)."""
    grammar_compile_timeout_s: float
    """DEEPINFER_GRAMMAR_COMPILE_TIMEOUT: seconds a grammar may take to compile before its request errors."""
    num_threads: int
    """DEEPINFER_NUM_THREADS: torch intra-op threads on CPU (0 = torch's default)."""
    spec_max_draft: int
    """DEEPINFER_SPEC_MAX_DRAFT: most draft tokens a request verifies per step under speculation (default 5)."""


def get_env() -> Env:
    return Env(
        cache_dir=Path(_str("DEEPINFER_CACHE", str(Path.home() / ".cache" / "deepinfer"))),
        batch_invariant=_bool("DEEPINFER_BATCH_INVARIANT", False),
        log_level=_str("DEEPINFER_LOG_LEVEL", "WARNING"),
        kv_cache_memory_fraction=_float("DEEPINFER_KV_CACHE_MEMORY_FRACTION", 0.85),
        kv_cache_max_cpu_gib=_float("DEEPINFER_KV_CACHE_MAX_CPU_GIB", 2.0),
        grammar_compile_timeout_s=_float("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT", 30.0),
        num_threads=_int("DEEPINFER_NUM_THREADS", 0),
        spec_max_draft=_int("DEEPINFER_SPEC_MAX_DRAFT", 5),
    )
