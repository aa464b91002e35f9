"""SamplingParams: validation names the offending field; constraint and stop normalisation."""
from __future__ import annotations

import json

import pytest

from deepinfer_rt.sampling_params import SamplingParams

VOCAB = 100

INVALID = [
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=-3)),
    ("max_new_tokens", dict(max_new_tokens=2.0)),
    ("min_new_tokens", dict(min_new_tokens=-1)),
    ("min_new_tokens", dict(min_new_tokens=5, max_new_tokens=4)),
    ("min_new_tokens", dict(min_new_tokens=1.5)),
    ("temperature", dict(temperature=-0.01)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=-0.5)),
    ("top_p", dict(top_p=1.01)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=3.0)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("frequency_penalty", dict(frequency_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("presence_penalty", dict(presence_penalty=2.01)),
    ("presence_penalty", dict(presence_penalty=-3.0)),
    ("n", dict(n=0)),
    ("n", dict(n=2.0)),
    ("seed", dict(seed="42")),
    ("seed", dict(seed=1.5)),
    ("top_logprobs", dict(top_logprobs=-1)),
    ("top_logprobs", dict(top_logprobs=21)),
    ("top_logprobs", dict(top_logprobs=2.0)),
    ("logprob_start_len", dict(logprob_start_len=-1)),
    ("logprob_start_len", dict(logprob_start_len=1.5)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=["ok", 3])),
    ("stop_token_ids", dict(stop_token_ids=[VOCAB])),
    ("stop_token_ids", dict(stop_token_ids=[1, -1])),
    ("stop_token_ids", dict(stop_token_ids=[1.0])),
    # loose types and unbounded values the server once passed through (issue: one request kills the engine)
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("stop_token_ids", dict(stop_token_ids=1.5)),
    ("stop_token_ids", dict(stop_token_ids=[True])),
    ("stop", dict(stop=5)),
    ("stop", dict(stop={"a": 1})),
    ("stop", dict(stop="\ud800")),
    ("stop", dict(stop=["x"] * 65)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("max_new_tokens", dict(max_new_tokens="16")),
    ("max_new_tokens", dict(max_new_tokens=10**30)),
    ("top_k", dict(top_k=10**30)),
    ("top_k", dict(top_k=2**63)),
    ("n", dict(n=True)),
    ("n", dict(n=10**9)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=-(2**63) - 1)),
    ("seed", dict(seed=True)),
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature=1e9)),
    ("temperature", dict(temperature=True)),
    ("temperature", dict(temperature="1")),
    ("top_p", dict(top_p=float("nan"))),
    ("repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("logprobs", dict(logprobs="no")),
    ("ignore_eos", dict(ignore_eos="no")),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs="yes")),
    ("logit_bias", dict(logit_bias={VOCAB: 1.0})),
    ("logit_bias", dict(logit_bias={1: 100.5})),
    ("logit_bias", dict(logit_bias={1: float("nan")})),
    ("logit_bias", dict(logit_bias=[1])),
    ("regex", dict(regex=3)),
    ("regex", dict(regex="a\udc00")),
    ("ebnf", dict(ebnf="x" * (256 * 1024 + 1))),
    ("json_schema", dict(json_schema=3)),
]


@pytest.mark.parametrize("field, kwargs", INVALID, ids=[f"{f}={list(k.values())}" for f, k in INVALID])
def test_validate_names_the_invalid_field(field, kwargs):
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as exc:
        p.validate(VOCAB)
    msg = str(exc.value)
    assert msg.startswith(f"SamplingParams.{field}:"), msg


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_json_schema_depth_and_size_are_bounded_without_recursion():
    SamplingParams(json_schema=_nested(20)).validate(VOCAB)
    for schema in (_nested(450), _nested(100_000), {"enum": ["\ud800"]}, {"enum": ["x" * (256 * 1024)]}):
        with pytest.raises(ValueError, match=r"^SamplingParams\.json_schema:"):
            SamplingParams(json_schema=schema).validate(VOCAB)


def test_limits_follow_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MAX_JSON_DEPTH", "4")
    with pytest.raises(ValueError, match="deeper than 4"):
        SamplingParams(json_schema=_nested(5)).validate(VOCAB)
    monkeypatch.setenv("DEEPINFER_MAX_GRAMMAR_CHARS", "10")
    with pytest.raises(ValueError, match="regex"):
        SamplingParams(regex="a" * 11).validate(VOCAB)


def test_more_than_one_constraint_rejected():
    for kwargs in (dict(regex="a+", json_schema={"type": "string"}), dict(regex="a", ebnf="root ::= 'a'"),
                   dict(json_schema="{}", ebnf="root ::= 'a'")):
        with pytest.raises(ValueError, match="regex/json_schema/ebnf"):
            SamplingParams(**kwargs).validate(VOCAB)


VALID = [
    dict(),
    dict(temperature=0.0),
    dict(top_p=1.0, top_k=-1, min_p=0.0),
    dict(top_k=0),
    dict(top_k=1, top_p=1e-6, min_p=1.0),
    dict(max_new_tokens=1, min_new_tokens=1),
    dict(repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=2.0),
    dict(n=4, seed=0),
    dict(seed=-5),
    dict(seed=2**64 - 1),
    dict(seed=-(2**63)),
    dict(top_k=2**31 - 1, temperature=100.0),
    dict(temperature=1, top_p=1, min_p=0, repetition_penalty=2),
    dict(json_schema=True),
    dict(stop=("a", "b")),
    dict(top_logprobs=20, logprobs=True, prompt_logprobs=True),
    dict(top_logprobs=0),
    dict(prompt_logprobs=True, logprob_start_len=7),
    dict(stop="x", stop_token_ids=[0, VOCAB - 1]),
    dict(stop=[], stop_token_ids=[]),
    dict(regex="[a-z]+"),
    dict(json_schema={"type": "object"}),
    dict(ebnf="root ::= 'a'"),
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_params_pass(kwargs):
    SamplingParams(**kwargs).validate(VOCAB)


def test_stop_string_normalisation():
    assert SamplingParams().stop_strings == []
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]
    stops = ["x"]
    p = SamplingParams(stop=stops)
    stops.append("y")
    assert p.stop_strings == ["x"]  # a copy, not the caller's list
    assert SamplingParams(stop="ab").stop_strings != ["a", "b"]  # a str is one stop string, not characters


def test_constraint_property():
    assert SamplingParams().constraint is None
    assert SamplingParams(regex="a|b").constraint == ("regex", "a|b")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    kind, text = SamplingParams(json_schema=schema).constraint
    assert kind == "json" and json.loads(text) == schema
    assert SamplingParams(json_schema='{"type": "string"}').constraint == ("json", '{"type": "string"}')
    assert SamplingParams(ebnf="root ::= 'a'").constraint == ("ebnf", "root ::= 'a'")
    assert SamplingParams(regex="").constraint == ("regex", "")  # an empty pattern is still a constraint


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy
