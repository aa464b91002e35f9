"""The server watches its engine process: a killed engine ends every open stream with an error event, control
endpoints answer at once, the engine is restarted (or the server exits non-zero once restarts are spent); a
stopped (stuck) engine makes /health say so, new requests are refused at once and open ones time out. A server
of its own on the tiny random Llama (fast to restart), with short heartbeat and request timeouts."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from server_helpers import server_info, start_server, stop_server, wait_idle

HEARTBEAT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 8.0
_ENV = {"DEEPINFER_HEARTBEAT_INTERVAL": "0.2", "DEEPINFER_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
        "DEEPINFER_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S), "DEEPINFER_CONTROL_TIMEOUT": "2",
        "DEEPINFER_GRAMMAR_COMPILE_TIMEOUT": "0"}  # every constrained generation fails in the engine

_ARGS = ("--kv-cache-tokens", "4096", "--max-num-seqs", "8", "--max-queued-requests", "8")


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_path, tmp_path_factory):
    proc, url = start_server(tiny_llama_path, tmp_path_factory.mktemp("tiny-server") / "server.log", _ENV,
                             extra_args=_ARGS)
    yield url, str(tiny_llama_path)
    stop_server(proc)


def _stream_lines(url: str, body: dict, route: str = "/generate"):
    """Open a streaming request; returns (response context, line iterator) after its first data line."""
    cm = httpx.stream("POST", f"{url}{route}", json=body, timeout=60)
    response = cm.__enter__()
    assert response.status_code == 200, response.read()
    lines = (line for line in response.iter_lines() if line.startswith("data: "))
    first = next(lines)
    return cm, first, lines


def _long_generation(max_new_tokens: int = 480) -> dict:
    """Long enough (the tiny model's context is 512) to be still running when the test acts on it."""
    return {"text": "once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}}


def test_failed_generation_is_a_500_not_a_200(tiny_server):
    url, _ = tiny_server
    bad = httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2,
                                                                                  "regex": "(["}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.regex", bad.text
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "[a-z]+ [0-9]{2}"}}
    failed = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert failed.status_code == 500, failed.text
    assert "grammar compilation exceeded" in failed.json()["error"]["message"]
    body["sampling_params"]["regex"] = "[a-z]+ [0-9]{3}"  # not the one compiled (late) and cached above
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 500
    wait_idle(url)


def test_stuck_engine_is_reported_and_requests_time_out(tiny_server):
    url, _ = tiny_server
    pid = server_info(url)["scheduler_pid"]
    cm, _, lines = _stream_lines(url, _long_generation())
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        deadline = stopped_at + HEARTBEAT_TIMEOUT_S + 5
        while httpx.get(f"{url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 with the engine stopped"
            time.sleep(0.2)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "not responding" in health.json()["error"]["message"]
        start = time.monotonic()
        refused = httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                             timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        for method, route in (("GET", "/get_server_info"), ("GET", "/metrics"), ("POST", "/flush_cache")):
            response = httpx.request(method, f"{url}{route}", timeout=10)
            assert response.status_code == 503, response.text
        assert time.monotonic() - start < 2.0  # answered at once, not after a timeout
        rest = list(lines)  # the open stream ends by its request timeout, with an error event
        assert time.monotonic() - stopped_at < REQUEST_TIMEOUT_S + 5
        events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
        assert events and events[-1]["error"]["code"] == "timeout", rest[-3:]
        assert rest[-1] == "data: [DONE]"
    finally:
        os.kill(pid, signal.SIGCONT)
        cm.__exit__(None, None, None)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "engine did not recover after SIGCONT"
        time.sleep(0.2)
    assert wait_idle(url)["scheduler_pid"] == pid  # the same engine, nothing left admitted


def test_killed_engine_ends_streams_answers_controls_and_restarts(tiny_server):
    url, _ = tiny_server
    pid = server_info(url)["scheduler_pid"]
    cm, _, lines = _stream_lines(url, _long_generation())
    try:
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rest = list(lines)
        assert time.monotonic() - killed_at < 5
        events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
        assert events and events[-1]["error"]["code"] == "engine_unavailable", rest[-3:]
        assert rest[-1] == "data: [DONE]"
        start = time.monotonic()
        for method, route in (("GET", "/get_server_info"), ("GET", "/metrics"), ("POST", "/flush_cache"),
                              ("GET", "/health")):
            response = httpx.request(method, f"{url}{route}", timeout=10)
            assert response.status_code == 503, (route, response.text)
        assert time.monotonic() - start < 2.0
    finally:
        cm.__exit__(None, None, None)
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "engine was not restarted"
        time.sleep(0.3)
    info = wait_idle(url)
    assert info["scheduler_pid"] != pid and info["num_engine_restarts"] == 1
    ok = httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()[0]["output_ids"]) <= 3


def test_engine_dead_for_good_exits_non_zero(tiny_llama_path, tmp_path):
    proc, url = start_server(tiny_llama_path, tmp_path / "server.log", {"DEEPINFER_ENGINE_MAX_RESTARTS": "0"},
                             extra_args=_ARGS)
    try:
        os.kill(server_info(url)["scheduler_pid"], signal.SIGKILL)
        assert proc.wait(30) != 0
        assert "gave up" in (tmp_path / "server.log").read_text()
    finally:
        stop_server(proc)
