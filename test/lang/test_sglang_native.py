"""SGLang's native HTTP protocol (deepinfer_rt/server/sglang_native.py): the router mounted on a FastAPI app of its
own over the tiny engine in-process (EngineManager stands in for the server's TokenizerManager; the same routes
run over it once http_server.py mounts them)."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deepinfer_rt.server import sglang_native


@pytest.fixture
def client(tiny_engine):
    tiny_engine.flush_cache()
    app = FastAPI()
    manager = sglang_native.EngineManager(tiny_engine)
    router = sglang_native.make_router(lambda: manager)
    app.include_router(router)
    with TestClient(app) as c:
        c.protocol = router.protocol
        yield c


def test_model_and_server_info_and_flush_cache(client, tiny_engine):
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] and client.get("/model_info").json() == info
    server = client.get("/get_server_info").json()
    assert server["max_running_requests"] == tiny_engine.config.scheduler.max_num_seqs
    assert "num_free_pages" in server["internal_states"][0]
    assert client.get("/server_info").status_code == 200
    for method in (client.post, client.get):
        response = method("/flush_cache")
        assert response.status_code == 200 and response.text.startswith("Cache flushed")


def test_generate_text_in_sglang_format(client, tiny_engine):
    body = {"text": "The sea is", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                      "skip_special_tokens": True}}
    out = client.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["completion_tokens"], len(out["output_ids"])) == (4, 4) and meta["prompt_tokens"] > 0
    direct = tiny_engine.generate(prompts=["The sea is"], sampling_params=sglang_native.sampling_params_of(
        {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}))[0]
    assert out["text"] == direct.text and out["output_ids"] == direct.token_ids
    again = client.post("/generate", json=body).json()
    assert again["meta_info"]["cached_tokens"] > 0 or meta["prompt_tokens"] < 16  # a page-sized prefix is reused


def test_generate_batch_ids_n_and_per_input_params(client):
    body = {"input_ids": [[1, 2, 3], [4, 5, 6, 7]],
            "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                {"max_new_tokens": 3, "n": 2, "ignore_eos": True}]}
    outs = client.post("/generate", json=body).json()
    assert isinstance(outs, list) and [o["meta_info"]["completion_tokens"] for o in outs] == [2, 3, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 4, 4]


def test_generate_logprobs(client, tiny_engine):
    body = {"text": "One two three four five", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    meta = client.post("/generate", json=body).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 2
    assert all(isinstance(lp, float) and isinstance(text, str) for lp, _, text in meta["input_token_logprobs"])
    assert len(meta["output_token_logprobs"]) == 3 and [len(r) for r in meta["output_top_logprobs"]] == [2, 2, 2]
    lp, tid, text = meta["output_token_logprobs"][0]
    assert text == tiny_engine.tokenizer.decode([tid])
    plain = client.post("/generate", json={**body, "return_text_in_logprobs": False}).json()["meta_info"]
    assert plain["output_token_logprobs"][0][2] is None
    no_lp = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).json()
    assert "output_token_logprobs" not in no_lp["meta_info"]


def test_prompt_only_request_scores_the_prompt(client):
    """SGLang's select: max_new_tokens=0 with prompt logprobs (RuntimeEndpoint.select's request)."""
    body = {"text": ["Colour: red", "Colour: blue"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 1}
    outs = client.post("/generate", json=body).json()
    for out in outs:
        assert out["text"] == "" and out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
        assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"] - 1


def test_generate_constrained(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.post("/generate", json={"text": "Code:", "sampling_params": {"max_new_tokens": 8,
                                                                               "regex": "[0-9]{3}"}}).json()
    assert re.fullmatch("[0-9]{3}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
    out = client.post("/generate", json={"text": "JSON:", "sampling_params": {"max_new_tokens": 32, "temperature": 0,
                                                                               "json_schema": json.dumps(schema)}})
    text, meta = out.json()["text"], out.json()["meta_info"]
    if meta["finish_reason"]["type"] == "stop":
        assert isinstance(json.loads(text)["n"], int)


def test_generate_stream_is_cumulative_sse(client):
    body = {"text": "Stream:", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0},
            "stream": True}
    with client.stream("POST", "/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))  # cumulative, as SGLang's
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    full = client.post("/generate", json={**body, "stream": False}).json()
    assert events[-1]["text"] == full["text"]


def test_errors_are_400_with_a_message(client):
    cases = [{"sampling_params": {"max_new_tokens": 1}},  # neither text nor input_ids
             {"text": "x", "sampling_params": {"bogus": 1}},
             {"text": "x", "sampling_params": {"stop_regex": "a+"}},
             {"text": "x", "sampling_params": {"temperature": -1}},
             {"text": ["a", "b"], "stream": True}]
    for body in cases:
        response = client.post("/generate", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["message"]


def test_abort_request_ends_a_running_request(client):
    result = {}

    def run():
        body = {"text": "Long:", "rid": "long-1",
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        result["out"] = client.post("/generate", json=body).json()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while "long-1" not in client.protocol.requests:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    assert client.post("/abort_request", json={"rid": "long-1"}).status_code == 200
    thread.join(60)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 4000
    assert client.post("/abort_request", json={"rid": "unknown"}).status_code == 200
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200


def test_register_mounts_under_a_prefix_and_keeps_existing_root_routes(tiny_engine):
    """As http_server.py mounts it: after its own /generate, /get_server_info and /flush_cache."""
    app = FastAPI()

    @app.post("/generate")
    async def native_generate():
        return {"native": True}

    manager = sglang_native.EngineManager(tiny_engine)
    protocol = sglang_native.register(app, lambda: manager)
    assert isinstance(protocol, sglang_native.SGLangProtocol)
    with TestClient(app) as c:
        assert c.post("/generate", json={}).json() == {"native": True}
        out = c.post("/sglang/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).json()
        assert out["meta_info"]["completion_tokens"] <= 2
        assert c.get("/get_model_info").json() == c.get("/sglang/get_model_info").json()
        assert c.get("/server_info").status_code == 200 and c.post("/abort_request", json={}).status_code == 200
