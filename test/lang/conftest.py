"""Fixtures for the frontend tests: a backend over the tiny random Llama (SmolLM2's tokenizer and template)."""
from __future__ import annotations

import pytest

from deepinfer_lang import RuntimeBackend
from deepinfer_rt import Engine


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=65536) as engine:
        yield engine


@pytest.fixture
def tiny_backend(tiny_engine):
    """A fresh backend (tests may swap its parts) over the shared tiny engine, its prefix cache emptied."""
    tiny_engine.flush_cache()
    return RuntimeBackend(tiny_engine)
