"""One bad request never takes down the engine, other requests or the server: one test per finding of the
hardening issue (schemathesis and hand-made inputs), each against the shared SmolLM2 server. The engine process
must survive every one of them (its pid unchanged) and every admitted sequence must be given back."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import MAX_NUM_SEQS, MAX_QUEUED, MODEL_NAME
from server_helpers import server_info, wait_idle

LIMIT = MAX_NUM_SEQS + MAX_QUEUED


def _post(url: str, route: str, body, timeout: float = 60) -> httpx.Response:
    # json.dumps, not httpx's json=: it must send what Python allows and strict JSON parsers do not (lone
    # surrogates), exactly as given
    return httpx.post(f"{url}{route}", content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=timeout)


def _assert_400(response: httpx.Response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(f"{param}["), error  # the field, or its item
    assert "SamplingParams" not in error["message"], error
    if not param.startswith("sampling_params"):  # the OpenAI API knows no engine names
        assert "min_new_tokens" not in error["message"] and "max_new_tokens" not in error["message"], error
    return error


@pytest.fixture
def engine_survives(server_url):
    """The test's requests leave the same engine process serving, healthy, with nothing admitted."""
    pid = server_info(server_url)["scheduler_pid"]
    yield
    assert httpx.get(f"{server_url}/health", timeout=10).text == "ok"
    ok = _post(server_url, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    info = wait_idle(server_url)
    assert info["scheduler_pid"] == pid, "the engine process died and was restarted"


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# 1. one request killed the engine (TypeError in SamplingParams.validate)
@pytest.mark.parametrize("value", [5, 1.5, "5", [True], [-1], {"a": 1}])
def test_1_stop_token_ids_of_a_wrong_type_is_400_and_the_engine_lives(server_url, engine_survives, value):
    response = _post(server_url, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4,
                                                                                "stop_token_ids": value}})
    _assert_400(response, "sampling_params.stop_token_ids")


# 2. a request failing before the engine leaked its admission for good
def test_2_failed_requests_release_their_admission(server_url, engine_survives):
    for n in (128, 128, 15):
        response = _post(server_url, "/generate", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 2, "n": n, "json_schema": _deep_schema(450)}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith("sampling_params.json_schema") and "deeper than" in error["message"]
        assert server_info(server_url)["num_inflight_seqs"] == 0
    # an n that could fit, with a bad prompt among the inputs: the good input's sequences are given back too
    response = _post(server_url, "/generate", {"input_ids": [[1, 2, 3], [4, 10**6]],
                                                "sampling_params": {"max_new_tokens": 2, "n": 30}})
    _assert_400(response, "input_ids")
    assert "input_ids[1]" in response.json()["error"]["message"]  # the second input is named, not input_ids[0]
    assert server_info(server_url)["num_inflight_seqs"] == 0
    ok = _post(server_url, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": LIMIT}})
    assert ok.status_code == 200 and len(ok.json()) == LIMIT  # the whole queue limit is available again


# 3. one request's top_k overflowed in the sampler and failed every request of the step
def test_3_huge_top_k_fails_no_other_request(server_url, engine_survives):
    async def main():
        async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
            good = [client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": f"Count {i}:",
                                                         "max_tokens": 4, "ignore_eos": True}) for i in range(4)]
            bad = [client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4,
                                                        "top_k": 10**30}),
                   client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4,
                                                                                     "top_k": 2**63}})]
            return await asyncio.gather(*good, *bad)

    *good, bad_v1, bad_native = asyncio.run(main())
    assert all(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length" for r in good)
    _assert_400(bad_v1, "top_k")
    _assert_400(bad_native, "sampling_params.top_k")


# 4. a 50 MB body froze the server; a 450-deep schema stalled concurrent requests
def test_4_huge_and_deep_bodies_are_refused_without_stalling_others(server_url, engine_survives):
    huge = b'{"model": "%s", "prompt": "' % MODEL_NAME.encode() + b"a" * (50 << 20) + b'"}'
    deep = json.dumps({"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {"schema": _deep_schema(450)}}})

    async def timed(coro):
        start = time.monotonic()
        response = await coro
        return response, time.monotonic() - start

    async def main():
        async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
            headers = {"content-type": "application/json"}

            async def chunked():  # no Content-Length: the limit is checked while reading
                for start in range(0, len(huge), 1 << 20):
                    yield huge[start:start + (1 << 20)]

            small = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
            return await asyncio.gather(timed(client.post("/v1/completions", content=huge, headers=headers)),
                                        timed(client.post("/v1/completions", content=chunked(), headers=headers)),
                                        timed(client.post("/v1/chat/completions", content=deep, headers=headers)),
                                        timed(small))

    (sized, t_sized), (streamed, t_streamed), (nested, t_nested), (small, t_small) = asyncio.run(main())
    assert sized.status_code == streamed.status_code == 413
    assert sized.json()["error"]["code"] == streamed.json()["error"]["code"] == "body_too_large"
    assert nested.status_code == 400 and nested.json()["error"]["code"] == "json_too_deep"
    assert small.status_code == 200
    assert max(t_sized, t_streamed, t_nested) < 10 and t_small < 10, (t_sized, t_streamed, t_nested, t_small)


# 5. plain-text 500s for parseable bad input
PARSEABLE_BAD = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi \ud800 there", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "a\ud83d"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 42}]}]}, "messages[0].content[0].text"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi", "name": "\ud800"}]}, "messages[0].name"),
    ("/generate", {"text": "\ud800", "sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": "2"}}, "sampling_params.n"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 2.0}}, "sampling_params.n"),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "stop": ["\udc00"]}},
     "sampling_params.stop[0]"),
]


@pytest.mark.parametrize("route,body,param", PARSEABLE_BAD, ids=[c[2] for c in PARSEABLE_BAD])
def test_5_parseable_bad_input_is_a_json_400(server_url, engine_survives, route, body, param):
    _assert_400(_post(server_url, route, body), param)


# 6. loose types and unbounded values were accepted
LOOSE = [
    ("/v1/completions", {"max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"logprobs": "no"}, "logprobs"),
    ("/v1/completions", {"ignore_eos": "no"}, "ignore_eos"),
    ("/v1/completions", {"stop": {"a": 1}}, "stop"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt[0]"),
    ("/v1/completions", {"temperature": 1e9}, "temperature"),
    ("/v1/completions", {"max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 9000}, "max_tokens"),  # beyond the 8192-token context
    ("/v1/chat/completions", {"max_tokens": 9000}, "max_tokens"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 1000}, "n"),
    ("/v1/completions", {"n": LIMIT + 1}, "n"),  # can never fit the queue limit: 400, not 503 "retry"
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "temperature": 1e9}}, "sampling_params.temperature"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "ignore_eos": "no"}}, "sampling_params.ignore_eos"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "logprobs": "no"}}, "sampling_params.logprobs"),
    ("/generate", {"sampling_params": {"max_new_tokens": 10**30}}, "sampling_params.max_new_tokens"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "n": 1000}}, "sampling_params.n"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "n": 0}}, "sampling_params.n"),
    ("/generate", {"sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}}, "sampling_params.min_new_tokens"),
    ("/generate", {"input_ids": [True, False]}, "input_ids[0]"),
]


@pytest.mark.parametrize("route,fields,param", LOOSE, ids=[f"{c[2]}-{i}" for i, c in enumerate(LOOSE)])
def test_6_loose_types_and_unbounded_values_are_400(server_url, engine_survives, route, fields, param):
    if route == "/generate":
        body = {"text": "Hi", **fields} if "input_ids" not in fields else {
            "sampling_params": {"max_new_tokens": 2}, **fields}
    elif route == "/v1/completions":
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **fields}
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    _assert_400(_post(server_url, route, body), param)


def test_6_infinity_is_not_a_temperature(server_url, engine_survives):
    for route, body, param in [
            ("/v1/completions", '{"model": "%s", "prompt": "Hi", "max_tokens": 2, "temperature": Infinity}'
             % MODEL_NAME, "temperature"),
            ("/generate", '{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": NaN}}',
             "sampling_params.temperature")]:
        response = httpx.post(f"{server_url}{route}", content=body, headers={"content-type": "application/json"},
                              timeout=60)
        _assert_400(response, param)


def test_6_tiny_temperature_samples_the_greedy_tokens(server_url, engine_survives):
    def ids(temperature):
        response = _post(server_url, "/generate", {"text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 4, "temperature": temperature, "ignore_eos": True, "seed": 1}})
        assert response.status_code == 200, response.text
        return response.json()[0]["output_ids"]

    assert ids(1e-300) == ids(0.0)
    assert ids(1e-300) != [0, 0, 0, 0]


# 7. one error shape, public names, honest OpenAPI
def test_7_every_error_has_one_shape(server_url):
    responses = [httpx.get(f"{server_url}/no-such-route"), httpx.get(f"{server_url}/v1/completions"),
                 httpx.post(f"{server_url}/v1/completions", content=b"{", headers={"content-type": "application/json"}),
                 httpx.post(f"{server_url}/generate", content=b"")]
    assert [r.status_code for r in responses] == [404, 405, 400, 400]
    for r in responses:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_7_openapi_declares_the_real_codes_and_response_schemas(server_url):
    schema = httpx.get(f"{server_url}/openapi.json").json()
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components and "ErrorResponse" in components
    for route in ("/v1/completions", "/v1/chat/completions", "/generate"):
        responses = schema["paths"][route]["post"]["responses"]
        assert "422" not in responses
        for status in ("400", "413", "503", "504"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
        assert "schema" in responses["200"]["content"]["application/json"]
    assert schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
