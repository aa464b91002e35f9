"""Fuzzing the request models: hypothesis builds bodies for /v1/completions, /v1/chat/completions and /generate
from each field's valid values and arbitrary JSON (wrong types, huge and non-finite numbers, lone surrogates,
nesting), and every one must be answered without a 5xx, in the one error shape, the server healthy after it and,
at the end, nothing left admitted. Generation is kept CPU-cheap: at most 4 new tokens, few samples."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import MODEL_NAME
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_helpers import server_info, wait_idle

MAX_EXAMPLES = 40
"""Per endpoint: about a minute in all on two cores."""

# Text with lone surrogates (json.dumps writes them as \\udXXX escapes, which Python's parser accepts).
_text = st.text(st.characters(exclude_categories=()), max_size=8)
_numbers = st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
_json = st.recursive(st.none() | st.booleans() | _numbers | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=6)


def _costly(low: int, high: int):
    """Drop ints in (low, high]: valid but expensive (many tokens or samples) on CPU."""
    return lambda v: not (type(v) is int and low < v <= high) and v is not None


_n = st.integers(1, 3) | st.integers(81, 200)  # beyond 80 the request can never fit: a 400
_token_ids = st.lists(st.integers(-2, 49_200), min_size=0, max_size=6)
_prompt = st.sampled_from(["Hi", "The sky is", ""]) | _text | _token_ids | st.lists(_token_ids, max_size=2) | _json
_schema = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "nonsense"}])
_response_format = (st.sampled_from([{"type": "text"}, {"type": "json_object"}])
                    | st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                                _schema | _json)
                    | _json)


_COSTLY_KEYS = {"max_tokens": _costly(4, 10**6), "max_completion_tokens": _costly(4, 10**6),
                "max_new_tokens": _costly(4, 10**6), "n": _costly(3, 80)}


def _mutated(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Half the bodies as valid as the field strategies make them; the others with one or two fields (or an
    unknown one) replaced by arbitrary JSON, so each bad value is met beside otherwise good fields."""
    @st.composite
    def build(draw):
        body = draw(valid)
        if isinstance(body, dict) and draw(st.booleans()):
            for _ in range(draw(st.integers(1, 2))):
                key = draw(st.sampled_from(sorted(body) + ["bogus"]))
                body[key] = draw(_json.filter(_COSTLY_KEYS.get(key, lambda v: True)))
        return body
    return build()


_SAMPLING = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(-1, 50) | st.integers(),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**64), 2**65), "stop": st.sampled_from([".", ["\n", "the"]]),
    "stop_token_ids": _token_ids, "ignore_eos": st.booleans(), "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(0, 3),
    "regex": st.sampled_from(["[a-z]+", "(["]),
}
_OPENAI = {**_SAMPLING, "stream": st.booleans(), "user": _text,
           "stream_options": st.builds(lambda b: {"include_usage": b}, st.booleans()),
           "response_format": _response_format, "min_tokens": st.integers(0, 3), "ebnf": st.just('root ::= "a"')}

_completion = _mutated(st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "prompt": _prompt, "max_tokens": st.integers(1, 4)},
    optional={**_OPENAI, "n": _n, "logprobs": st.integers(0, 3), "echo": st.booleans(), "suffix": _text}))
_message = _mutated(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])},
    optional={"content": _text | st.lists(_mutated(st.fixed_dictionaries({"type": st.just("text"), "text": _text})),
                                          max_size=2),
              "name": _text}))
_chat = _mutated(st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "messages": st.lists(_message, min_size=0, max_size=3),
     "max_tokens": st.integers(1, 4)},
    optional={**_OPENAI, "n": _n, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
              "max_completion_tokens": st.integers(1, 4), "tools": _json}))
_native_params = _mutated(st.fixed_dictionaries(
    {"max_new_tokens": st.integers(1, 4)},
    optional={**_SAMPLING, "n": _n, "min_new_tokens": st.integers(0, 3), "logprobs": st.booleans(),
              "top_logprobs": st.integers(0, 3), "json_schema": _schema, "prompt_logprobs": st.booleans(),
              "logprob_start_len": st.integers(0, 3)}))
_generate = _mutated(st.one_of(
    st.fixed_dictionaries({"text": _text | st.lists(_text, max_size=2)},
                          optional={"sampling_params": _native_params | st.lists(_native_params, max_size=2),
                                    "stream": st.booleans()}),
    st.fixed_dictionaries({"input_ids": _prompt},
                          optional={"sampling_params": _native_params | st.lists(_native_params, max_size=2),
                                    "stream": st.booleans()})))


def _check(url: str, route: str, body) -> None:
    response = httpx.post(f"{url}{route}", content=json.dumps(body), headers={"content-type": "application/json"},
                          timeout=120)
    assert response.status_code < 500, (route, body, response.text)
    event(f"HTTP {response.status_code}")  # pytest --hypothesis-show-statistics: how many got through
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text
    elif "text/event-stream" in response.headers.get("content-type", ""):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", (route, body, response.text[-500:])
        assert not any(line.startswith('data: {"error"') for line in events), (route, body, response.text[-500:])
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def engine_pid(server_url) -> int:
    return server_info(server_url)["scheduler_pid"]


@_SETTINGS
@given(body=_completion)
def test_fuzz_completions(server_url, engine_pid, body):
    _check(server_url, "/v1/completions", body)


@_SETTINGS
@given(body=_chat)
def test_fuzz_chat_completions(server_url, engine_pid, body):
    _check(server_url, "/v1/chat/completions", body)


@_SETTINGS
@given(body=_generate)
def test_fuzz_generate(server_url, engine_pid, body):
    _check(server_url, "/generate", body)


def test_fuzzing_left_nothing_admitted(server_url, engine_pid):
    info = wait_idle(server_url)
    assert info["num_inflight_seqs"] == 0
    assert info["scheduler_pid"] == engine_pid, "the engine process died during fuzzing"
