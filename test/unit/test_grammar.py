"""Structured output backend alone (CPU, real SmolLM2 tokenizer, no model): validation, compilation cache and
timeouts, masks on mixed batches, and random walks whose every finished output must satisfy its constraint.

A random walk stands in for a model: random logits each step, masked by the grammar, then a Gumbel draw at
temperature 1. Any token the mask lets through is a possible model output, so a walk that ends in text
violating the constraint is a bug in the mask or in how tokens map to text.
"""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from deepinfer_rt.constrained.grammar import GrammarBackend, RequestGrammar
from deepinfer_rt.sampling_params import SamplingParams

V = 49152
EOS = 2
NUM_SEEDS = 50
MAX_STEPS = 200


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The walks run many small tensor ops; on a shared 2-core machine two intra-op threads make them ~5x
    # slower (they wait for each other), not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def backend(tokenizer):
    be = GrammarBackend(tokenizer, V, (EOS,), compile_timeout_s=60.0)
    yield be
    be.close()


def ready(backend: GrammarBackend, kind: str, text: str) -> RequestGrammar:
    backend.validate(kind, text)
    handle = backend.submit(kind, text)
    backend.wait([handle])
    status, grammar = backend.poll(handle)
    assert status == "ready", grammar
    return grammar


def allowed(backend: GrammarBackend, grammar: RequestGrammar) -> set[int]:
    logits = torch.zeros(1, V)
    backend.fill_and_apply(logits, [grammar])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def random_walks(backend, tokenizer, kind: str, text: str, seeds=range(NUM_SEEDS)) -> tuple[list[str], int]:
    """One walk per seed, all in one batch. Returns the decoded texts of the walks that terminated and the
    number that ran out of steps."""
    live: list[RequestGrammar | None] = [ready(backend, kind, text) for _ in seeds]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    outputs: list[list[int]] = [[] for _ in seeds]
    for _ in range(MAX_STEPS):
        rows = [i for i, g in enumerate(live) if g is not None]
        if not rows:
            break
        logits = torch.zeros(len(seeds), V)  # finished rows stay in the batch, unconstrained
        for i in rows:
            logits[i] = torch.randn(V, generator=gens[i])
        backend.fill_and_apply(logits, live)
        for i in rows:
            noise = torch.rand(V, generator=gens[i]).clamp_(min=1e-20)
            token = int((logits[i] - torch.log(-torch.log(noise))).argmax())
            assert live[i].accept(token), f"seed {seeds[i]}: masked draw {token} rejected by its grammar"
            outputs[i].append(token)
            if live[i].is_terminated():
                assert token == EOS and not live[i].failed
                live[i] = None
    done = [tokenizer.decode(ids, skip_special_tokens=True) for ids, g in zip(outputs, live) if g is None]
    return done, sum(g is not None for g in live)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kind, text, field, why", [
    ("regex", "a(b", "SamplingParams.regex", "invalid regular expression"),
    ("regex", "(?=a)a", "SamplingParams.regex", "invalid regular expression"),
    ("json", "{not json", "SamplingParams.json_schema", "not valid JSON"),
    ("json", "[1, 2]", "SamplingParams.json_schema", "must be a JSON object or boolean"),
    ("json", '{"type": "foo"}', "SamplingParams.json_schema", "unsupported or invalid schema"),
    ("json", '{"type": "integer", "minimum": 5, "maximum": 1}', "SamplingParams.json_schema", "minimum"),
    ("json", '{"type": "string", "minLength": 5, "maxLength": 1}', "SamplingParams.json_schema", "minLength"),
    ("ebnf", 'root ::= "a" |', "SamplingParams.ebnf", "invalid grammar"),
    ("ebnf", 'expr ::= "a"', "SamplingParams.ebnf", "root"),
    ("ebnf", 'root ::= undefined_rule', "SamplingParams.ebnf", "undefined_rule"),
])
def test_validate_rejects_invalid_constraints(backend, kind, text, field, why):
    with pytest.raises(ValueError) as info:
        backend.validate(kind, text)
    msg = str(info.value)
    assert msg.startswith(field + ":") and why in msg
    assert "/project/cpp" not in msg  # xgrammar's C++ log prefix is stripped


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
      "then": {"properties": {"a": {"minimum": 1}}}}, "if"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "integer", "allOf": [{"minimum": 3}]}, "allOf"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, "maxLength"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "(?!b)."}}}, "(?!b)."),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"type": "integer", "not": {}}}}},
     "#/properties/deep/items"),
])
def test_validate_refuses_schemas_xgrammar_would_not_enforce(backend, schema, keyword):
    with pytest.raises(ValueError) as info:
        backend.validate("json", json.dumps(schema))
    assert str(info.value).startswith("SamplingParams.json_schema: unsupported schema")
    assert keyword in str(info.value)


@pytest.mark.parametrize("schema", [
    True,
    {},
    {"type": "integer", "multipleOf": 3},
    {"allOf": [{"$ref": "#/$defs/A"}], "description": "one allOf is fine", "$defs": {"A": {"type": "boolean"}}},
    {"type": "string", "format": "date", "title": "annotations are fine"},
    # Property names and enum values are data, not keywords.
    {"type": "object", "properties": {"not": {"type": "string", "enum": ["uniqueItems", "if"]}}},
])
def test_validate_accepts_supported_schemas(backend, schema):
    backend.validate("json", json.dumps(schema))


def test_validate_accepts_dict_schema_through_sampling_params(backend):
    kind, text = SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}).constraint
    backend.validate(kind, text)
    ok = allowed(backend, ready(backend, kind, text))
    assert ok and all(backend.tokenizer_info.decoded_vocab[t].startswith(b"{") for t in ok)


def test_validate_rejects_unknown_kind_and_non_string(backend):
    with pytest.raises(ValueError, match="kind"):
        backend.validate("grammar", "root ::= 'a'")
    with pytest.raises(ValueError, match="SamplingParams.regex: expected a string"):
        backend.validate("regex", 3)


# ---------------------------------------------------------------- compilation: cache, errors, timeout


def test_second_submit_hits_the_cache(backend):
    hits, misses = backend.cache_hits, backend.cache_misses
    h1 = backend.submit("regex", r"cache-test-\d+")
    h2 = backend.submit("regex", r"cache-test-\d+")
    assert h2.future is h1.future
    assert (backend.cache_hits, backend.cache_misses) == (hits + 1, misses + 1)
    h3 = backend.submit("ebnf", r'root ::= "cache-test"')
    assert h3.future is not h1.future and backend.cache_misses == misses + 2
    backend.wait([h1])
    s1, g1 = backend.poll(h1)
    s2, g2 = backend.poll(h2)
    # One compilation, but each request gets its own matcher.
    assert s1 == s2 == "ready" and g1.matcher is not g2.matcher
    assert g1.accept(backend.tokenizer_info.decoded_vocab.index(b"c"))
    assert allowed(backend, g2) != allowed(backend, g1)


def test_compile_timeout_gives_error(backend, monkeypatch):
    release = threading.Event()

    def slow_compile(kind, text):
        release.wait(30)
        raise RuntimeError("released")

    monkeypatch.setattr(backend, "_compile", slow_compile)
    monkeypatch.setattr(backend, "compile_timeout_s", 0.3)
    try:
        handle = backend.submit("regex", "timeout-test")
        assert backend.poll(handle) == ("pending", None)
        backend.wait([handle])  # returns at the deadline, not when the (stuck) compilation ends
        assert time.monotonic() - handle.submitted_at < 5
        time.sleep(0.05)
        assert backend.poll(handle) == ("error", "grammar compilation exceeded 0.3 s")
    finally:
        release.set()


def test_compile_that_ends_before_the_first_poll_still_counts_its_time(backend, monkeypatch):
    real = backend._compile

    def slowish(kind, text):
        time.sleep(0.2)
        return real(kind, text)

    monkeypatch.setattr(backend, "_compile", slowish)
    monkeypatch.setattr(backend, "compile_timeout_s", 0.1)
    handle = backend.submit("regex", "late-[a-z]+")
    handle.future.result(timeout=60)  # done before anyone polls
    assert backend.poll(handle) == ("error", "grammar compilation exceeded 0.1 s")
    monkeypatch.setattr(backend, "compile_timeout_s", 0.0)
    assert backend.poll(backend.submit("regex", "late-[a-z]+"))[0] == "ready"  # compiled earlier: cached


def test_compile_exception_gives_error(backend, monkeypatch):
    def broken(kind, text):
        raise RuntimeError("[12:00:00] /project/cpp/x.cc:1: kaboom")

    monkeypatch.setattr(backend, "_compile", broken)
    handle = backend.submit("regex", "exception-test")
    with pytest.raises(RuntimeError):
        handle.future.result(timeout=60)
    assert backend.poll(handle) == ("error", "grammar compilation failed: kaboom")


# ---------------------------------------------------------------- masks


def test_mask_touches_only_constrained_rows_and_ids_beyond_vocab(backend):
    g1 = ready(backend, "regex", r"\d{4}-\d{2}-\d{2}")
    g2 = ready(backend, "regex", r"[a-z]+")
    width = V + 64  # padded lm_head: ids >= V are not tokens and must never be drawn under a grammar
    logits = torch.randn(5, width, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows_before = backend.stats["rows"]
    backend.fill_and_apply(logits, [g1, None, g2, None, None])
    for i in (1, 3, 4):
        assert torch.equal(logits[i], before[i])
    assert backend.stats["rows"] == rows_before + 2
    digits = {backend.tokenizer_info.decoded_vocab.index(str(d).encode()) for d in range(10)}
    ok = torch.isfinite(logits[0])
    assert set(ok.nonzero().flatten().tolist()) == digits
    assert torch.equal(logits[0, ok], before[0, ok])  # allowed logits are not changed
    assert torch.isinf(logits[[0, 2], V:]).all()
    # Narrower logits than the tokenizer vocab (a truncated lm_head) are masked up to their width.
    narrow = torch.zeros(2, V - 100)
    backend.fill_and_apply(narrow, [None, g1])
    assert set(torch.isfinite(narrow[1]).nonzero().flatten().tolist()) == digits
    assert torch.isfinite(narrow[0]).all()


def test_bitmask_grows_with_the_batch(backend):
    g = ready(backend, "regex", r"[a-z]+")
    batch = backend._bitmask.shape[0] * 2 + 3
    logits = torch.zeros(batch, V)
    backend.fill_and_apply(logits, [None] * (batch - 1) + [g])
    assert torch.isfinite(logits[:-1]).all()
    assert not torch.isfinite(logits[-1]).all()


def test_eos_only_where_the_grammar_may_end(backend, tokenizer):
    g = ready(backend, "regex", r"\d{4}-\d{2}-\d{2}")
    assert EOS not in allowed(backend, g)
    for t in tokenizer.encode("2024-01-3", add_special_tokens=False):
        assert g.accept(t)
    assert EOS not in allowed(backend, g)
    assert g.accept(tokenizer.encode("1", add_special_tokens=False)[0])
    assert allowed(backend, g) == {EOS}
    assert not g.is_terminated() and g.accept(EOS) and g.is_terminated()


def test_special_tokens_are_never_text(backend, tokenizer):
    # The regex admits "<|im_end|>" and friends as text; the tokens with that text must still be masked,
    # since the detokenizer drops them (and EOS mid-output would end the request).
    g = ready(backend, "regex", r"[a-z<|>_]+")
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert EOS in specials and len(specials) > 3
    ok = allowed(backend, g)
    assert len(ok) > 1000 and not ok & specials
    assert g.accept(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert allowed(backend, g) & specials == {EOS}


def test_length_bounded_strings_admit_no_raw_control_characters(backend):
    # xgrammar 0.2.9's length-bounded strings let tab and U+0000-U+001F in (invalid JSON) unless the backend
    # swaps their character class for the one of its unbounded strings.
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 6}},
              "required": ["s"]}
    g = ready(backend, "json", json.dumps(schema))
    assert g.matcher.accept_string('{"s": "')
    vocab = backend.tokenizer_info.decoded_vocab
    ok = allowed(backend, g)
    assert len(ok) > 1000
    assert [vocab[t] for t in ok if any(b < 0x20 for b in vocab[t])] == []


# ---------------------------------------------------------------- RequestGrammar


def test_rejected_token_marks_the_request_failed(backend, tokenizer):
    g = ready(backend, "regex", r"\d+")
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not g.failed and not g.accept(letter)
    assert g.failed and g.is_terminated() and str(letter) in g.error
    assert not g.accept(tokenizer.encode("1", add_special_tokens=False)[0])  # stays failed


def test_rebuild_and_fork_reproduce_the_state(backend, tokenizer):
    text = '{"name": "Al", "tags": ["x"'
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array", "items": {"type": "string"}}}}
    ids = tokenizer.encode(text, add_special_tokens=False)
    g = ready(backend, "json", json.dumps(schema))
    for t in ids:
        assert g.accept(t)
    expected = allowed(backend, g)
    fresh = ready(backend, "json", json.dumps(schema))
    assert allowed(backend, fresh) != expected
    fresh.rebuild(ids)
    assert allowed(backend, fresh) == expected and not fresh.failed

    fork = g.fork()
    assert fork.accept(tokenizer.encode("]", add_special_tokens=False)[0])
    assert allowed(backend, g) == expected  # the original did not move
    assert allowed(backend, fork) != expected

    g.rebuild(ids + [tokenizer.encode("}}}", add_special_tokens=False)[0]])
    assert g.failed
    g.rebuild(ids)  # a rebuild starts over, failure included
    assert not g.failed and allowed(backend, g) == expected


# ---------------------------------------------------------------- random walks

REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(Mr|Ms|Dr)\. [A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
        "active": {"type": "boolean"},
        "nickname": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["name", "age", "role", "tags", "address"],
}

# Arithmetic with bounded repetition and nesting, so walks end: at most three products of at most two atoms,
# an atom a number or a parenthesised flat expression.
EBNF = r"""
root ::= sum
sum ::= prod (("+" | "-") prod){0,2}
prod ::= atom (("*" | "/") atom){0,1}
atom ::= num | "(" flat ")"
flat ::= num (("+" | "-" | "*" | "/") num){0,2}
num ::= [0-9]{1,2}
"""


class Arith:
    """Recursive-descent recogniser of EBNF above."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def parses(self) -> bool:
        try:
            self.series(self.prod, "+-", 2)
            return self.i == len(self.s)
        except ValueError:
            return False

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def series(self, item, ops: str, max_more: int) -> None:
        item()
        for _ in range(max_more):
            if self.peek() == "" or self.peek() not in ops:
                return
            self.i += 1
            item()

    def prod(self) -> None:
        self.series(self.atom, "*/", 1)

    def atom(self) -> None:
        if self.peek() == "(":
            self.i += 1
            self.series(self.num, "+-*/", 2)
            if self.peek() != ")":
                raise ValueError
            self.i += 1
        else:
            self.num()

    def num(self) -> None:
        start = self.i
        while self.peek().isascii() and self.peek().isdigit() and self.i - start < 2:
            self.i += 1
        if self.i == start:
            raise ValueError


def test_arith_checker_can_fail():
    assert all(Arith(t).parses() for t in ["1", "12+3*4", "(1+2*3)/45-6", "1-2-3"])
    assert not any(Arith(t).parses() for t in ["", "123", "1-2-3-4", "1*2*3", "((1))", "(1+2+3+4)", "1+"])


@pytest.mark.parametrize("pattern", REGEXES)
def test_random_walks_match_regex(backend, tokenizer, pattern):
    texts, unfinished = random_walks(backend, tokenizer, "regex", pattern)
    assert unfinished == 0
    for text in texts:
        assert re.fullmatch(pattern, text), text
    assert len(set(texts)) > NUM_SEEDS // 2


def test_random_walks_validate_json_schema(backend, tokenizer):
    texts, unfinished = random_walks(backend, tokenizer, "json", json.dumps(SCHEMA))
    assert len(texts) >= NUM_SEEDS * 0.9, f"{unfinished} walks did not finish"
    seen_keys = set()
    for text in texts:
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        seen_keys |= value.keys()
    # The walks explore the optional keys too, so the check covers more than one shape.
    assert seen_keys == set(SCHEMA["properties"])


def test_random_walks_parse_ebnf(backend, tokenizer):
    texts, unfinished = random_walks(backend, tokenizer, "ebnf", EBNF)
    assert unfinished == 0
    for text in texts:
        assert Arith(text).parses(), text
    assert any("(" in t for t in texts) and any("*" in t or "/" in t for t in texts)


def test_stats_report_mask_times(backend):
    backend.reset_stats()
    grammars = [ready(backend, "regex", r"[a-z]+"), None, ready(backend, "regex", r"\d+")]
    for _ in range(4):
        backend.fill_and_apply(torch.zeros(3, V), grammars)
    stats = backend.stats
    assert stats["rows"] == 8 and stats["total_us"] > 0
    assert 0 < stats["p50_us"] <= stats["p99_us"]
    assert stats["mean_us"] == pytest.approx(stats["total_us"] / stats["rows"])
    backend.reset_stats()
    assert backend.stats["rows"] == 0 and backend.stats["p99_us"] == 0.0
