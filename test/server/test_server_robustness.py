"""The server under abuse: aborted streams free their KV, the queue limit answers 503 with Retry-After, bad
requests get 400 naming the field, and 64 concurrent streaming clients lose and duplicate nothing."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from conftest import MAX_NUM_SEQS, MAX_QUEUED, MODEL_NAME
from server_helpers import server_info, wait_idle

from deepinfer_rt import SamplingParams


def _chat_body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a long story."}], **fields}


def _assert_kv_idle(url: str) -> None:
    """No KV page is held by a request: every page is free or in the prefix cache, and free after a flush."""
    info = wait_idle(url)
    assert info["num_free_pages"] + info["num_cached_pages"] == info["num_pages"], info
    httpx.post(f"{url}/flush_cache", timeout=30)
    info = server_info(url)
    assert info["num_free_pages"] == info["num_pages"], info


def test_abort_mid_stream_frees_kv(server_url):
    _assert_kv_idle(server_url)
    before = server_info(server_url)["num_generated_tokens"]
    body = _chat_body(max_tokens=400, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break  # leaving the block closes the connection mid-stream
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    _assert_kv_idle(server_url)
    assert server_info(server_url)["num_generated_tokens"] - before < 400  # the request stopped early


def test_client_gone_before_a_non_streaming_response_aborts(server_url):
    before = server_info(server_url)["num_generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server_url}/v1/chat/completions", json=_chat_body(max_tokens=400, ignore_eos=True),
                   timeout=httpx.Timeout(60, read=1.5))
    _assert_kv_idle(server_url)
    assert server_info(server_url)["num_generated_tokens"] - before < 400


def test_queue_limit_answers_503_with_retry_after(server_url):
    limit = MAX_NUM_SEQS + MAX_QUEUED
    # more than can ever fit is the client's mistake (400), not a reason to retry (503)
    never = httpx.post(f"{server_url}/v1/chat/completions", json=_chat_body(max_tokens=4, n=limit + 1), timeout=60)
    assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text
    body = _chat_body(max_tokens=200, ignore_eos=True, n=limit, stream=True)
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept referenced: a collected iterator closes the connection
        assert next(lines).startswith("data: ")
        assert server_info(server_url)["num_inflight_seqs"] == limit
        refused = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi",
                                                                    "max_tokens": 2}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
    _assert_kv_idle(server_url)
    ok = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


BAD_REQUESTS = [
    # (route, body, param the error names, words in the message)
    ("/v1/chat/completions", _chat_body(model="no-such-model"), "model", "unknown model"),
    ("/v1/chat/completions", _chat_body(max_tokens=-5), "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 0}, "max_tokens", "only with echo"),
    ("/v1/chat/completions", _chat_body(temperature=-1), "temperature", "greater"),
    ("/v1/chat/completions", _chat_body(n=0), "n", "greater"),
    ("/v1/chat/completions", _chat_body(messages=[]), "messages", "at least 1"),
    ("/v1/chat/completions", _chat_body(top_logprobs=2), "top_logprobs", "requires logprobs"),
    ("/v1/chat/completions", _chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}),
     "response_format", "schema"),
    ("/v1/chat/completions", _chat_body(response_format={"type": "yaml"}), "response_format.type", "json_schema"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "regex": "(["}, "regex", "regular expression"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "regex": "a", "ebnf": 'root ::= "a"'}, "regex",
     "at most one"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hello " * 9000}, "prompt", "does not fit"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [[1, 2], [10**9]]}, "prompt", "token ids"),
    ("/v1/completions", {"model": MODEL_NAME}, "prompt", "Field required"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": 42}, "prompt", "valid"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "bogus": 1}}, "sampling_params.bogus",
     "not permitted"),
]


@pytest.mark.parametrize("route,body,param,words", BAD_REQUESTS, ids=[f"{b[2]}-{i}" for i, b in
                                                                    enumerate(BAD_REQUESTS)])
def test_bad_request_gets_400_naming_the_field(server_url, route, body, param, words):
    response = httpx.post(f"{server_url}{route}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_malformed_json_then_still_serving(server_url, client):
    response = httpx.post(f"{server_url}/v1/chat/completions", content=b'{"model": "smollm2", "messages": [',
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400
    assert "malformed JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "Hi"}])
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{server_url}/health").status_code == 200


NUM_CLIENTS, REQUESTS_PER_CLIENT, MAX_TOKENS = 64, 4, 6
_LOAD_PROMPTS = ["The weather today is", "My favourite animal is", "In the year 2000,", "A good breakfast has",
                 "The ocean is", "Programming languages like", "The best way to learn is", "Mountains are"]


def test_load_64_concurrent_streaming_clients(server_url, smollm2_engine):
    refs = smollm2_engine.generate(_LOAD_PROMPTS, sampling_params=SamplingParams(
        max_new_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    expected = {p: r.text for p, r in zip(_LOAD_PROMPTS, refs)}

    async def one_client(aclient, k: int) -> list[tuple[str, str, list[str], int, str]]:
        results = []
        for j in range(REQUESTS_PER_CLIENT):
            prompt = _LOAD_PROMPTS[(k + j) % len(_LOAD_PROMPTS)]
            stream = await aclient.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, tokens, usage, finish = "", [], None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    text += c.text
                    tokens += c.logprobs.tokens if c.logprobs else []
                    finish = c.finish_reason or finish
            results.append((prompt, text, tokens, usage, finish))
        return results

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one_client(aclient, k) for k in range(NUM_CLIENTS)))

    start = time.monotonic()
    results = [r for client_results in asyncio.run(main()) for r in client_results]
    elapsed = time.monotonic() - start
    assert len(results) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    for prompt, text, tokens, usage, finish in results:
        assert finish == "length"
        assert usage == len(tokens) == MAX_TOKENS  # every token streamed exactly once
        assert "".join(tokens) == text
        assert text == expected[prompt]
    assert elapsed < 120
    _assert_kv_idle(server_url)
    assert httpx.get(f"{server_url}/health").status_code == 200
