"""Per-request sampling parameters (public API contract, see ARCHITECTURE.md section 2)."""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from typing import ClassVar

from deepinfer_rt.env import get_env

MAX_INT = 2**31 - 1
"""Bound of the integer fields (counts, lengths, top_k): an int32 on the device, and far beyond any context."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds are 64-bit (signed or unsigned); the sampler mixes them modulo 2**64."""
MAX_N = 4096
MAX_TEMPERATURE = 100.0
"""Beyond it the draw is uniform to float32 precision for any real logits: a larger value is a mistake."""
MAX_TOP_LOGPROBS = 20
"""Alternatives reported per position (top_logprobs, a prompt_logprobs count)."""
MAX_STOP_STRINGS = 64
"""Each stop string is searched for in every step's text; the bound keeps that cost small."""


def is_valid_text(value) -> bool:
    """A str that encodes to UTF-8 (JSON's \\ud800 escapes parse into lone surrogates, which do not)."""
    if not isinstance(value, str):
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_MAX_PATH_DEPTH = 4


def find_json_problem(value, max_depth: int) -> tuple[str, str] | None:
    """(path, why) of the first container nested deeper than max_depth or string that is not valid UTF-8 in a
    parsed JSON value, else None. Iterative: a value too deep for recursion is reported, not crashed on."""
    stack = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if not is_valid_text(node):
                return path, "must be valid UTF-8 text (it holds a lone surrogate)"
            continue
        if not isinstance(node, (dict, list, tuple)):
            continue
        if depth > max_depth:
            return path, f"nested deeper than {max_depth} levels"
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(key, str) and not is_valid_text(key):
                return path, "holds a key that is not valid UTF-8 text"
            if isinstance(child, (str, dict, list, tuple)):
                if depth <= _MAX_PATH_DEPTH:
                    child_path = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
                else:
                    child_path = path  # deeper down, where the structure starts is enough
                stack.append((child, depth + 1, child_path))
    return None


_REPR = reprlib.Repr()
"""Values quoted in error messages: short, and safe on structures too deep for repr()."""
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 2, 60, 40, 60


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float (never a bool, never inf/nan)."""
    if _is_int(value):
        return True
    return isinstance(value, float) and math.isfinite(value)


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
    prompt_logprobs: bool | int = False
    """True: the logprob of each prompt token (the first has none: None). An int k >= 1: that, plus the k most
    likely tokens at each prompt position (prompt_top_logprobs; evaluation harnesses compare the two to tell
    whether a continuation is greedy). False or 0: none."""
    logprob_start_len: int = 0
    """With prompt_logprobs: report logprobs only for prompt positions >= this (earlier entries are None).
    Positions before it may come from the prefix cache, so scoring continuations of a shared prefix
    (select-style) computes the prefix once."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a value in [-100, 100] added to its logit before sampling (OpenAI semantics: -100 bans the
    token, +100 all but forces it). Reported logprobs stay those of the model's own distribution."""
    regex: str | None = None
    json_schema: str | dict | bool | None = None
    ebnf: str | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    max_top_logprobs: ClassVar[int] = 20
    """Bound of top_logprobs (the sampler returns any count; the DeepInfer-compatible API allows 1000)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:  # None, or a wrong type that validate() names
            self.stop_strings = []

    @property
    def num_prompt_top_logprobs(self) -> int:
        """k of a prompt_logprobs count (0 for a bool)."""
        p = self.prompt_logprobs
        return 0 if isinstance(p, bool) else p

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
        """Raise ValueError naming the offending field. Every field is type-checked (a bool is not a number,
        floats are finite, integers bounded, strings valid UTF-8), so no later stage meets a surprise."""

        def check(ok, name: str, why: str) -> None:
            if not ok:
                got = _REPR.repr(getattr(self, name))
                raise ValueError(f"SamplingParams.{name}: {why} (got {got})")

        def check_int(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            check(_is_int(value) and low <= value <= high, name, f"must be an int in [{low}, {high}]")

        def check_number(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high
            check(ok, name, f"must be a finite number in {'(' if low_open else '['}{low}, {high}]")

        check_int("max_new_tokens", 1, MAX_INT)
        check_int("min_new_tokens", 0, self.max_new_tokens)
        check_number("temperature", 0.0, MAX_TEMPERATURE)
        check_number("top_p", 0.0, 1.0, low_open=True)
        check(_is_int(self.top_k) and (self.top_k == -1 or 0 <= self.top_k <= MAX_INT), "top_k",
              f"must be -1 or an int in [0, {MAX_INT}]")
        check_number("min_p", 0.0, 1.0)
        check_number("repetition_penalty", 0.0, MAX_TEMPERATURE, low_open=True)
        check_number("frequency_penalty", -2.0, 2.0)
        check_number("presence_penalty", -2.0, 2.0)
        check_int("n", 1, MAX_N)
        check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]), "seed",
              "must be None or a 64-bit int")
        for name in ("ignore_eos", "logprobs"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(isinstance(self.prompt_logprobs, bool) or (_is_int(self.prompt_logprobs)
              and 0 <= self.prompt_logprobs <= self.max_top_logprobs), "prompt_logprobs",
              f"must be a bool or an int in [0, {self.max_top_logprobs}] (the top tokens per position)")
        check_int("top_logprobs", 0, self.max_top_logprobs)
        check_int("logprob_start_len", 0, MAX_INT)
        check(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
              "must be a string or a list of strings")
        check(len(self.stop_strings) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        check(all(is_valid_text(s) and s for s in self.stop_strings), "stop", "must be non-empty UTF-8 strings")
        if self.stop_token_ids is not None:
            check(isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) <= MAX_STOP_STRINGS
                  and all(_is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
                  f"must be a list of at most {MAX_STOP_STRINGS} token ids in [0, {vocab_size})")
        if self.logit_bias is not None:
            bias = self.logit_bias
            check(isinstance(bias, dict) and all(_is_int(t) and 0 <= t < vocab_size and _is_number(v)
                                                 and -100.0 <= v <= 100.0 for t, v in bias.items()), "logit_bias",
                  f"must map token ids in [0, {vocab_size}) to numbers in [-100, 100]")
        env = get_env()
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            check(value is None or (is_valid_text(value) and len(value) <= env.max_grammar_chars), name,
                  f"must be UTF-8 text of at most {env.max_grammar_chars} characters")
        schema = self.json_schema
        if isinstance(schema, (dict, bool)):
            problem = find_json_problem(schema, env.max_json_depth)
            where = "the schema" if not problem or not problem[0] else problem[0][:60]
            check(problem is None, "json_schema", f"{where} {problem[1]}" if problem else "")
            schema = json.dumps(schema)
        check(schema is None or (is_valid_text(schema) and len(schema) <= env.max_grammar_chars), "json_schema",
              f"must be a JSON object, a boolean or a string of at most {env.max_grammar_chars} characters")
        num_constraints = sum(c is not None for c in (self.regex, self.json_schema, self.ebnf))
        if num_constraints > 1:
            raise ValueError("SamplingParams.regex/json_schema/ebnf: at most one constraint per request")
