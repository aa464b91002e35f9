"""Structured output (regex, JSON schema, EBNF) through xgrammar: validation, async compilation, token masks.

Life of a constrained request:
  submission   GrammarBackend.validate(kind, text)  -> ValueError naming the field (parsing only, fast)
               handle = GrammarBackend.submit(kind, text)  (compiles on a worker thread, cached by (kind, text))
  scheduling   GrammarBackend.poll(handle) -> ("pending", None) | ("error", msg) | ("ready", RequestGrammar)
  each step    GrammarBackend.fill_and_apply(logits, grammars): -inf on the tokens each grammar forbids
  each token   RequestGrammar.accept(token); the request stops when RequestGrammar.is_terminated()

The engine's eos ids are the matchers' stop tokens, so EOS is allowed exactly where the grammar may end, and a
grammar that has matched completely allows only EOS.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import time
from dataclasses import dataclass, field

import torch
import xgrammar

logger = logging.getLogger(__name__)

KINDS = ("regex", "json", "ebnf")
_FIELDS = {"regex": "SamplingParams.regex", "json": "SamplingParams.json_schema", "ebnf": "SamplingParams.ebnf"}

# Whitespace between JSON tokens is free (models format JSON their own way) but bounded: with unbounded
# whitespace a small model can loop on newlines forever inside a constrained object.
_JSON_OPTIONS = dict(any_whitespace=True, max_whitespace_cnt=16)
_CACHE_ENTRIES = 64
"""Compiled grammars kept (LRU); one JSON schema takes ~0.1-5 MB."""
_STATS_WINDOW = 65536
"""Percentiles of the mask time cover the latest this many constrained rows."""

# xgrammar 0.2.9 turns these JSON-schema keywords into no constraint at all (checked by comparing the grammars
# it builds with and without them), so outputs could violate the schema: they are refused at submission.
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                     "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
# Keywords that never constrain a value (allowed next to an allOf, which xgrammar only handles alone).
_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor", "$defs", "definitions"))
# Where subschemas live (keywords refused above are not walked).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
               "propertyNames")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: \(.*?\) is false: )?")


def _xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: ...")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _LOG_PREFIX.sub("", text)
    return text if len(text) <= 300 else text[:297] + "..."


def _subschemas(schema: dict, path: str):
    """(JSON pointer, subschema) of the direct subschemas of a schema object."""
    for kw in _SCHEMA_MAPS:
        if isinstance(schema.get(kw), dict):
            for name, sub in schema[kw].items():
                yield f"{path}/{kw}/{name}", sub
    for kw in _SCHEMA_ONE:
        if isinstance(schema.get(kw), dict):
            yield f"{path}/{kw}", schema[kw]
    for kw in _SCHEMA_LISTS:
        if isinstance(schema.get(kw), list):
            for i, sub in enumerate(schema[kw]):
                yield f"{path}/{kw}/{i}", sub


def _unsupported_in_schema(schema, path: str = "#") -> str | None:
    """Why xgrammar cannot enforce this schema (first problem found, with its JSON pointer), or None."""
    if not isinstance(schema, dict):
        return None
    for kw in _IGNORED_KEYWORDS:
        if kw in schema:
            return f"keyword '{kw}' at {path} is not enforced by the grammar backend"
    if schema.get("uniqueItems") is True:
        return f"keyword 'uniqueItems' at {path} is not enforced by the grammar backend"
    if "allOf" in schema and (not isinstance(schema["allOf"], list) or len(schema["allOf"]) != 1
                              or not set(schema) - {"allOf"} <= _ANNOTATIONS):
        return (f"'allOf' at {path} is only supported with a single subschema and no other constraints "
                "beside it")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return f"'$ref' at {path} must point inside the schema ('#...'), got {ref!r}"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return f"minLength/maxLength at {path} cannot be combined with 'pattern' or 'format'"
    if "multipleOf" in schema and not (schema.get("type") == "integer" and isinstance(schema["multipleOf"], int)):
        return f"'multipleOf' at {path} is only supported as an integer on type 'integer'"
    patterns = [(f"{path}/pattern", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [(f"{path}/patternProperties", p) for p in schema["patternProperties"]]
    for where, pattern in patterns:
        # Inside a schema xgrammar drops what it cannot do (lookarounds, ...) with a log line; alone it raises.
        try:
            xgrammar.Grammar.from_regex(pattern)
        except RuntimeError as e:
            return f"pattern {pattern!r} at {where}: {_xgrammar_message(e)}"
    for sub_path, sub in _subschemas(schema, path):
        if (why := _unsupported_in_schema(sub, sub_path)) is not None:
            return why
    return None


def _json_schema_grammar(text: str) -> xgrammar.Grammar:
    """The grammar of a JSON schema (raises RuntimeError from xgrammar if it cannot build one).

    xgrammar 0.2.9 builds length-bounded strings (minLength/maxLength) from a character class that excludes
    only the quote, backslash, CR and LF, so raw control characters (tab, U+0000-U+001F) get into the string:
    invalid JSON. The class is replaced in the grammar's text (which parses back to the same grammar) by the
    one its unbounded strings use; if a later xgrammar fixes it, the text no longer contains it."""
    grammar = xgrammar.Grammar.from_json_schema(text, **_JSON_OPTIONS)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR not in ebnf:
        return grammar
    return xgrammar.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


class RequestGrammar:
    """One request's position in its grammar (an xgrammar.GrammarMatcher).

    A rejected token (possible only if the mask was not applied to the row that produced it) marks the
    request failed: `error` says why and is_terminated() turns True, so it stops instead of running on
    unconstrained.
    """

    __slots__ = ("matcher", "error")

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self.matcher = matcher
        self.error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def accept(self, token: int) -> bool:
        if self.error is not None:
            return False
        if not self.matcher.accept_token(token):
            self.error = f"token {token} violates the grammar"
            logger.warning("constrained request produced a token its grammar rejects: %d", token)
            return False
        return True

    def is_terminated(self) -> bool:
        return self.error is not None or self.matcher.is_terminated()

    def rebuild(self, output_ids: list[int]) -> None:
        """Back to the start of the grammar, then through output_ids (a retracted request resuming)."""
        self.matcher.reset()
        self.error = None
        for token in output_ids:
            if not self.accept(token):
                return

    def fork(self) -> "RequestGrammar":
        """An independent copy at the same position (shares the compiled grammar)."""
        forked = RequestGrammar(self.matcher.fork())
        forked.error = self.error
        return forked


@dataclass(eq=False)
class GrammarHandle:
    """A submitted compilation: poll it through GrammarBackend.poll."""
    future: concurrent.futures.Future = field(repr=False)
    submitted_at: float


class GrammarBackend:
    """One per engine. Not thread-safe: submit/poll/fill_and_apply belong to the thread that runs the steps
    (compilation itself runs on the backend's own worker threads)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...], compile_timeout_s: float,
                 max_workers: int = 2):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.tokenizer_info = self._tokenizer_info(tokenizer, vocab_size, eos_ids)
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_workers,
                                                 cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = \
            collections.OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0
        self._bitmask = xgrammar.allocate_token_bitmask(8, vocab_size)  # (rows, ceil(V / 32)) int32
        self._mask_ns: collections.deque[int] = collections.deque(maxlen=_STATS_WINDOW)
        self._mask_rows = 0
        self._mask_total_ns = 0

    @staticmethod
    def _tokenizer_info(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> xgrammar.TokenizerInfo:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_ids) or None)
        # from_huggingface keeps special tokens (<|im_end|>, ...) as their literal text, so a grammar would
        # allow them wherever that text fits (even the EOS token mid-output), while the detokenizer drops
        # them. An empty string is how xgrammar marks a token special (never allowed); stop tokens stay
        # allowed through stop_token_ids, only where the grammar may end.
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(eos_ids)
        if not special:
            return info
        vocab = [b"" if i in special else piece for i, piece in enumerate(info.decoded_vocab)]
        return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)

    # ---- submission ----
    def validate(self, kind: str, text: str) -> None:
        """Raise ValueError naming the SamplingParams field if the constraint cannot be used."""
        if kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {kind!r}")
        name = _FIELDS[kind]
        if not isinstance(text, str):
            raise ValueError(f"{name}: expected a string, got {type(text).__name__}")
        if kind == "regex":
            try:
                xgrammar.Grammar.from_regex(text)
            except RuntimeError as e:
                raise ValueError(f"{name}: invalid regular expression: {_xgrammar_message(e)}") from None
        elif kind == "ebnf":
            try:
                xgrammar.Grammar.from_ebnf(text)
            except RuntimeError as e:
                raise ValueError(f"{name}: invalid grammar: {_xgrammar_message(e)}") from None
        else:
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}: not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{name}: a schema must be a JSON object or boolean, got {type(schema).__name__}")
            why = _unsupported_in_schema(schema)
            if why is not None:
                raise ValueError(f"{name}: unsupported schema: {why}")
            try:
                _json_schema_grammar(text)
            except RuntimeError as e:
                raise ValueError(f"{name}: unsupported or invalid schema: {_xgrammar_message(e)}") from None

    def submit(self, kind: str, text: str) -> GrammarHandle:
        """Start compiling (kind, text) off the calling thread, or reuse the cached compilation."""
        key = (kind, text)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
        else:
            self.cache_misses += 1
            future = self._pool.submit(self._timed_compile, kind, text)
            self._cache[key] = future
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return GrammarHandle(future, time.monotonic())

    def _timed_compile(self, kind: str, text: str) -> tuple[xgrammar.CompiledGrammar, float]:
        """The compiled grammar and when it was done (a compilation that ends before the first poll still counts
        its time against the timeout)."""
        return self._compile(kind, text), time.monotonic()

    def _compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "json":
            return self.compiler.compile_grammar(_json_schema_grammar(text))
        return self.compiler.compile_grammar(text)

    def poll(self, handle: GrammarHandle) -> tuple[str, RequestGrammar | str | None]:
        """Non-blocking: ("ready", a fresh RequestGrammar) | ("pending", None) | ("error", message)."""
        future = handle.future
        if future.cancelled():
            return "error", "grammar backend closed"
        if not future.done():
            if time.monotonic() - handle.submitted_at > self.compile_timeout_s:
                return "error", f"grammar compilation exceeded {self.compile_timeout_s:g} s"
            return "pending", None
        exc = future.exception()
        if exc is not None:
            return "error", f"grammar compilation failed: {_xgrammar_message(exc)}"
        compiled, finished_at = future.result()
        if finished_at - handle.submitted_at > self.compile_timeout_s:  # cached earlier: finished before submission
            return "error", f"grammar compilation exceeded {self.compile_timeout_s:g} s"
        return "ready", RequestGrammar(xgrammar.GrammarMatcher(compiled))

    def wait(self, handles: list[GrammarHandle], max_wait_s: float | None = None) -> None:
        """Block until one of these compilations ends, the earliest of them times out, or `max_wait_s`: for a
        scheduler that has nothing else to run (rather than spinning on poll)."""
        deadline = min(h.submitted_at for h in handles) + self.compile_timeout_s
        timeout = max(0.0, deadline - time.monotonic())
        if max_wait_s is not None:
            timeout = min(timeout, max_wait_s)
        concurrent.futures.wait([h.future for h in handles], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- each step ----
    def fill_and_apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
        """logits (B, V') fp32, one row per entry of grammars: in place, -inf on every token the row's grammar
        forbids, including ids >= vocab_size; rows whose grammar is None are left untouched."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        batch, width = logits.shape
        if self._bitmask.shape[0] < batch:
            self._bitmask = xgrammar.allocate_token_bitmask(max(batch, 2 * self._bitmask.shape[0]),
                                                            self.vocab_size)
        fill_ns = []
        for i in rows:
            t0 = time.perf_counter_ns()
            grammars[i].matcher.fill_next_token_bitmask(self._bitmask, i)
            fill_ns.append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        bitmask = self._bitmask[:batch]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        # Bitmask row i masks logits row i; only the constrained rows are touched.
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(width, self.vocab_size), indices=rows)
        if width > self.vocab_size:
            logits[rows, self.vocab_size:] = float("-inf")
        share = (time.perf_counter_ns() - t0) // len(rows)
        self._mask_ns.extend(ns + share for ns in fill_ns)
        self._mask_rows += len(rows)
        self._mask_total_ns += sum(fill_ns) + share * len(rows)

    # ---- statistics and teardown ----
    @property
    def stats(self) -> dict:
        """Mask time per constrained row per step (its bitmask fill plus its share of the apply), in µs."""
        recent = sorted(self._mask_ns)

        def pct(q: float) -> float:
            return recent[min(len(recent) - 1, int(q * len(recent)))] / 1e3 if recent else 0.0

        return {"rows": self._mask_rows, "total_us": self._mask_total_ns / 1e3,
                "mean_us": self._mask_total_ns / 1e3 / self._mask_rows if self._mask_rows else 0.0,
                "p50_us": pct(0.5), "p99_us": pct(0.99),
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses}

    def reset_stats(self) -> None:
        self._mask_ns.clear()
        self._mask_rows = 0
        self._mask_total_ns = 0

    def close(self) -> None:
        """Stop compiling: queued compilations are dropped; a running one finishes in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
