"""Configuration of speculative decoding (Engine(speculative=...))."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_rt.env import get_env

METHODS = ("prompt_lookup", "mtp", "dspark")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "prompt_lookup"
    """'prompt_lookup' (n-gram match over the request's own tokens), 'mtp' (DeepSeek MTP head) or 'dspark'
    (DeepSeek-V4.1's DSpark block drafter)."""
    max_draft: int = 0
    """Most draft tokens verified per request and step; 0 = DEEPINFER_SPEC_MAX_DRAFT (default 5)."""
    fixed_length: bool | None = None
    """Verify every proposed draft (up to max_draft) instead of choosing by confidence: the number verified
    then never depends on the rest of the batch. None = on exactly when the engine is batch-invariant."""
    min_ngram: int = 1
    max_ngram: int = 3
    """Prompt lookup: n-gram lengths matched against earlier tokens, longest first."""
    drafter: Any = None
    """A Drafter object to use instead of `method` (tests, external drafters)."""

    @classmethod
    def parse(cls, value: str | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(value, cls):
            config = value
        elif isinstance(value, str):
            config = cls(method=value)
        else:
            raise ValueError(f"speculative must be None, one of {METHODS} or a SpeculativeConfig, got {value!r}")
        if config.drafter is None and config.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {config.method!r}")
        if config.max_draft < 0 or not 1 <= config.min_ngram <= config.max_ngram:
            raise ValueError("speculative: max_draft >= 0 and 1 <= min_ngram <= max_ngram")
        return config

    @property
    def num_draft(self) -> int:
        return self.max_draft or get_env().spec_max_draft
