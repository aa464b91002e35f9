"""No silent ignores: every request field the server does not implement is refused with a 400 naming it; the
ones it implements (logit_bias, seed, stream_options, model "default") change the answer as documented."""
from __future__ import annotations

import httpx
import pytest
from conftest import MODEL_NAME

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x1": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"999999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": []}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]},
     "messages[0].colour"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "g"},
                                                               "extra": 1}]}, "tools[0].extra"),
])
def test_unknown_or_unsupported_fields_are_refused(server_url, path, body, param):
    r = _post(server_url, path, {"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error


def test_model_default_is_this_model(client):
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.model == MODEL_NAME and out.choices[0].text


def test_best_of_returns_the_most_likely_samples(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3)
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert [c.text for c in best.choices] == sorted(totals, key=lambda t: -totals[t])[:2]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all four were generated


def test_logit_bias_forces_and_bans(client, smollm2_engine):
    tok = smollm2_engine.tokenizer
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == tok.decode([forced] * 3)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, temperature=0,
                                           logprobs=True)
    first = tok.encode(plain.choices[0].message.content, add_special_tokens=False)[0]
    banned = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, temperature=0,
                                            logprobs=True, logit_bias={str(first): -100})
    assert tok.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first
    # logprobs stay those of the model's own distribution: the banned token's would be the best
    assert banned.choices[0].logprobs.content[0].logprob < plain.choices[0].logprobs.content[0].logprob


def test_seed_reproducible_in_chat(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11)
    a, b = (client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2))
    assert a == b


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_options_include_usage(client, include_usage):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": include_usage}))
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage) == 1 and usage[0].completion_tokens == 3 and chunks[-1].choices == []
    else:
        assert usage == []
