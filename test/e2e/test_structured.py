"""Structured output through the public API on tiny random models: every output that finishes with "stop"
satisfies its regex / JSON schema / EBNF grammar, whatever the (random) model prefers.

A random model is the hard case: it never wants the format, so the mask alone has to produce it.
"""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from deepinfer_rt import Engine, SamplingParams

NUM_SEEDS = 50
DATE = r"\d{4}-\d{2}-\d{2}"
PROMPTS = ["hello world", "the sea is", "one two three four five six seven", "a"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "city": {"type": "string", "maxLength": 10}},
                    "required": ["zip"]},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
    },
    "required": ["name", "age", "role", "tags", "address"],
}

# A regular EBNF grammar, so re checks it: up to four "key=value" pairs.
EBNF = r"""
root ::= pair ("," " "? pair){0,3}
pair ::= [a-z]{1,6} "=" [0-9]{1,3}
"""
EBNF_RE = r"[a-z]{1,6}=[0-9]{1,3}(, ?[a-z]{1,6}=[0-9]{1,3}){0,3}"


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=16384) as e:
        yield e


def sampled(max_new_tokens: int, seeds=range(NUM_SEEDS), **constraint) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=s, max_new_tokens=max_new_tokens, **constraint) for s in seeds]


def assert_json_valid(outs, schema, min_finished: float) -> None:
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= min_finished * len(outs), [o.finish_reason for o in outs]
    assert all(o.finish_reason == "length" for o in outs if o.finish_reason != "stop")
    for o in finished:
        jsonschema.validate(json.loads(o.text), schema)


def test_regex_sampled_outputs_match(engine):
    outs = engine.generate(PROMPTS[:1] * NUM_SEEDS, sampling_params=sampled(16, regex=DATE))
    # Eleven tokens at most (digits are single tokens, then EOS), so every one finishes.
    assert [o.finish_reason for o in outs] == ["stop"] * NUM_SEEDS
    for o in outs:
        assert re.fullmatch(DATE, o.text), o.text
        assert o.token_ids[-1] in engine.eos_ids
    assert len({o.text for o in outs}) > NUM_SEEDS // 2


def test_json_schema_dict_sampled_outputs_validate(engine):
    outs = engine.generate(PROMPTS[1:2] * NUM_SEEDS, sampling_params=sampled(256, json_schema=SCHEMA))
    assert_json_valid(outs, SCHEMA, min_finished=0.8)


def test_json_schema_as_text_is_the_same_constraint(engine):
    as_dict = engine.generate(PROMPTS[:2], sampling_params=sampled(256, range(2), json_schema=SCHEMA))
    as_text = engine.generate(PROMPTS[:2], sampling_params=sampled(256, range(2), json_schema=json.dumps(SCHEMA)))
    assert [o.token_ids for o in as_text] == [o.token_ids for o in as_dict]


def test_ebnf_sampled_outputs_parse(engine):
    outs = engine.generate(PROMPTS[2:3] * NUM_SEEDS, sampling_params=sampled(64, ebnf=EBNF))
    # At most 4 pairs of at most 10 characters plus EOS: always within 64 tokens.
    assert [o.finish_reason for o in outs] == ["stop"] * NUM_SEEDS
    for o in outs:
        assert re.fullmatch(EBNF_RE, o.text), o.text


def test_greedy_constrained(engine):
    params = [SamplingParams(temperature=0, max_new_tokens=16, regex=DATE),
              SamplingParams(temperature=0, max_new_tokens=256, json_schema=SCHEMA),
              SamplingParams(temperature=0, max_new_tokens=64, ebnf=EBNF),
              SamplingParams(temperature=0, max_new_tokens=16, regex=DATE, ignore_eos=True)]
    outs = engine.generate(PROMPTS, sampling_params=params)
    assert re.fullmatch(DATE, outs[0].text) and outs[0].finish_reason == "stop"
    assert_json_valid(outs[1:2], SCHEMA, min_finished=0.0)
    assert re.fullmatch(EBNF_RE, outs[2].text) and outs[2].finish_reason == "stop"
    # ignore_eos does not run past the end of the grammar.
    assert re.fullmatch(DATE, outs[3].text) and outs[3].finish_reason == "stop"
    again = engine.generate(PROMPTS, sampling_params=params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_max_new_tokens_truncates_with_length(engine):
    (out,) = engine.generate(PROMPTS[:1], sampling_params=SamplingParams(
        temperature=1.0, seed=3, max_new_tokens=5, regex=r"[a-z]{40}"))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch(r"[a-z]+", out.text) and len(out.text) < 40


@pytest.mark.parametrize("params, field", [
    (dict(regex="a(b"), "SamplingParams.regex"),
    (dict(json_schema="{not json"), "SamplingParams.json_schema"),
    (dict(json_schema={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "SamplingParams.json_schema"),
    (dict(json_schema={"type": "nonsense"}), "SamplingParams.json_schema"),
    (dict(ebnf='root ::= "a" |'), "SamplingParams.ebnf"),
    (dict(ebnf='start ::= "a"'), "SamplingParams.ebnf"),
    (dict(regex="a+", json_schema={"type": "integer"}), "SamplingParams.regex/json_schema/ebnf"),
])
def test_invalid_constraints_fail_at_submission(engine, params, field):
    with pytest.raises(ValueError) as info:
        engine.generate(PROMPTS[:2], sampling_params=[SamplingParams(max_new_tokens=4), SamplingParams(**params)])
    assert str(info.value).startswith(field)
    assert not engine.scheduler.has_work  # nothing of the batch was submitted
    (out,) = engine.generate(PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=3, regex="[0-9]+"))
    assert re.fullmatch("[0-9]+", out.text)


def test_mixed_batch_leaves_unconstrained_requests_alone(engine):
    plain = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    alone = engine.generate(PROMPTS, sampling_params=plain)
    constrained = sampled(64, range(4), json_schema=SCHEMA)
    mixed = engine.generate([p for p in PROMPTS for _ in (0, 1)],
                            sampling_params=[x for pair in zip([plain] * 4, constrained) for x in pair])
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    assert_json_valid(mixed[1::2], SCHEMA, min_finished=0.0)


def test_n_samples_constrained(engine):
    outs = engine.generate(PROMPTS[:2], sampling_params=SamplingParams(
        temperature=1.0, seed=11, n=3, max_new_tokens=16, regex=DATE))
    assert len(outs) == 6
    assert all(o.finish_reason == "stop" and re.fullmatch(DATE, o.text) for o in outs)
    assert len({o.text for o in outs[:3]}) > 1  # siblings draw differently, each within the grammar


def test_stream_constrained(engine):
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=64, ebnf=EBNF)
    full = engine.generate(PROMPTS[:1], sampling_params=params)[0].text
    assert "".join(engine.stream(PROMPTS[0], params)) == full and re.fullmatch(EBNF_RE, full)


def test_retraction_keeps_outputs_valid(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=64) as e:
        outs = e.generate(PROMPTS * 4, sampling_params=sampled(16, range(16), regex=DATE))
        assert e.stats["num_retractions"] > 0
        assert all(o.finish_reason == "stop" and re.fullmatch(DATE, o.text) for o in outs), \
            [(o.finish_reason, o.text) for o in outs]
        outs = e.generate(PROMPTS * 2, sampling_params=sampled(24, range(8), ebnf=EBNF))
        assert all(o.finish_reason != "stop" or re.fullmatch(EBNF_RE, o.text) for o in outs)
        assert sum(o.finish_reason == "stop" for o in outs) >= 4


def test_compile_error_and_timeout_fail_only_their_request(engine, monkeypatch):
    """Compilation runs off the scheduler thread: a request whose grammar fails (or takes too long) ends with
    finish_reason 'error', and the rest of the batch is served meanwhile."""
    backend = engine.grammar

    def broken(kind, text):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(backend, "_compile", broken)
    plain = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    ok, bad = engine.generate(PROMPTS[:2], sampling_params=[plain, SamplingParams(regex="never-compiled-1")])
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    assert bad.finish_reason == "error" and "synthetic failure" in bad.error

    release = threading.Event()

    def stuck(kind, text):
        release.wait(30)
        raise RuntimeError("released")

    monkeypatch.setattr(backend, "_compile", stuck)
    monkeypatch.setattr(backend, "compile_timeout_s", 0.5)
    try:
        ok, slow = engine.generate(PROMPTS[:2], sampling_params=[plain, SamplingParams(regex="never-compiled-2")])
    finally:
        release.set()
    assert ok.finish_reason == "length"
    assert slow.finish_reason == "error" and "exceeded" in slow.error


def test_deepseek_tokenizer(tiny_v3_path):
    with Engine(str(tiny_v3_path), dtype="float32", kv_cache_tokens=8192) as e:
        outs = e.generate(["hello"] * 20, sampling_params=sampled(16, range(10), regex=DATE)
                          + sampled(256, range(10), json_schema=SCHEMA))
        assert all(o.finish_reason == "stop" and re.fullmatch(DATE, o.text) for o in outs[:10])
        assert_json_valid(outs[10:], SCHEMA, min_finished=0.5)


def test_grammar_backend_built_once_by_concurrent_callers(tiny_llama_path):
    """Constrained requests submitted from many threads at once (run_batch) share one grammar backend."""
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as e:
        start = threading.Barrier(6)
        seen = []

        def first_use():
            start.wait()
            seen.append(e.grammar)

        threads = [threading.Thread(target=first_use) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(seen) == 6 and all(g is seen[0] for g in seen) and e.executor.grammar is seen[0]
