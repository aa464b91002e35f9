"""Per-request sampling parameters (public API contract, see ARCHITECTURE.md section 2)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    """EOS and stop_token_ids are banned until this many tokens exist (not for constrained requests, whose
    grammar decides where they may end)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) means no top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """HF semantics: logits of tokens seen in prompt or output are divided (>0) or multiplied (<0) by it."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    """Stop strings; the text is cut before the first one and it is not emitted."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    """Seeded draws depend only on (seed, output position, logits): reproducible across runs and batches."""
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    logprob_start_len: int = 0
    """With prompt_logprobs: report logprobs only for prompt positions >= this (earlier entries are None).
    Positions before it may come from the prefix cache, so scoring continuations of a shared prefix
    (select-style) computes the prefix once."""
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, if any."""
        if self.regex is not None:
            return "regex", self.regex
        if self.json_schema is not None:
            schema = self.json_schema
            return "json", schema if isinstance(schema, str) else json.dumps(schema)
        if self.ebnf is not None:
            return "ebnf", self.ebnf
        return None

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the offending field."""

        def check(ok, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool), name, "must be a number")

        check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens", "must be an int >= 1")
        check(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens,
              "min_new_tokens", "must be an int in [0, max_new_tokens]")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), "top_k", "must be -1 or >= 0")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an int >= 1")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an int or None")
        check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20, "top_logprobs",
              "must be an int in [0, 20]")
        check(isinstance(self.logprob_start_len, int) and self.logprob_start_len >= 0, "logprob_start_len",
              "must be an int >= 0")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", "must be non-empty strings")
        if self.stop_token_ids is not None:
            check(all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
                  f"must be token ids in [0, {vocab_size})")
        num_constraints = sum(c is not None for c in (self.regex, self.json_schema, self.ebnf))
        if num_constraints > 1:
            raise ValueError("SamplingParams.regex/json_schema/ebnf: at most one constraint per request")
