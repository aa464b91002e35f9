"""The server through the official openai client: completions and chat, streaming and not, n, stop, JSON
schema, logprobs; greedy outputs equal the in-process engine's."""
from __future__ import annotations

import json
import math

import httpx
import jsonschema
import pytest
from conftest import MODEL_NAME

from deepinfer_rt import SamplingParams

PROMPT = "The three primary colors are"
QUESTION = "Name a fruit that is yellow."


def _chat_ids(engine, content: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_models_and_health(server_url, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server_url}/health").text == "ok"
    metrics = httpx.get(f"{server_url}/metrics").text
    for name in ("deepinfer_num_waiting_requests", "deepinfer_num_running_requests",
                 "deepinfer_gen_throughput_tokens_per_s", "deepinfer_cache_hit_rate", "deepinfer_kv_pool_free_pages"):
        assert f"\n{name} " in metrics


def test_completion_greedy_equals_engine_streamed_or_not(client, smollm2_engine):
    ref = smollm2_engine.generate([PROMPT], sampling_params=SamplingParams(max_new_tokens=12, temperature=0))[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.prompt_tokens, ref.completion_tokens)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_chat_greedy_equals_engine_streamed_or_not(client, smollm2_engine):
    ids = _chat_ids(smollm2_engine, QUESTION)
    ref = smollm2_engine.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=16,
                                                                                  temperature=0))[0]
    messages = [{"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == ref.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason


def test_n_samples_seeded(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in out.choices)
    assert len({c.text for c in out.choices}) > 1  # distinct seeded streams per sample
    assert out.usage.prompt_tokens == client.completions.create(**{**kwargs, "n": 1}).usage.prompt_tokens
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # the seed reproduces them
    streamed = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in out.choices]


def test_stop_string(client, smollm2_engine):
    ref = smollm2_engine.generate([PROMPT], sampling_params=SamplingParams(max_new_tokens=12, temperature=0))[0]
    stop = ref.text.split()[1]  # a word the greedy continuation reaches
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ref.text[: ref.text.index(stop)]
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Give a person's name and age as JSON."}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=48, temperature=0,
                                          response_format=fmt, stream=stream)
    if stream:
        chunks = list(resp)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_regex_extension(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Any JSON."}],
                                         max_tokens=32, temperature=0, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still an object's beginning
        assert out.choices[0].message.content.lstrip().startswith("{")
    out = client.completions.create(model=MODEL_NAME, prompt="Year:", max_tokens=8, temperature=0,
                                    extra_body={"regex": r"[12][0-9]{3}"})
    assert out.choices[0].finish_reason == "stop"
    assert len(out.choices[0].text) == 4 and out.choices[0].text.isdigit()


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0.0
        # greedy: the sampled token is the most likely one
        assert item.top_logprobs[0].token == item.token
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob, abs_tol=1e-5)
        assert sum(math.exp(t.logprob) for t in item.top_logprobs) <= 1.0 + 1e-5
    assert "".join(item.token for item in content) == out.choices[0].message.content


def test_completion_logprobs_streamed_equal_non_streamed(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    out = client.completions.create(**kwargs)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    streamed = [t for c in client.completions.create(**kwargs, stream=True) if c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
