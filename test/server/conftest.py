"""One server for the whole server test session: SmolLM2 on loopback, on a free port, stopped at the end (and
its scheduler process checked gone)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "smollm2"
MAX_NUM_SEQS = 64
MAX_QUEUED = 16
_START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def server_url(smollm2_path, tmp_path_factory, request):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "deepinfer_rt.cli", "serve", "--model", str(smollm2_path), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--dtype", "float32", "--kv-cache-tokens", "16384",
           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED)]
    # One torch thread: the server shares the test machine's cores with this process and its clients, and
    # oversubscribed intra-op threads slow a CPU forward several times over.
    env = {**os.environ, "DEEPINFER_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        request.getfixturevalue("smollm2_engine")  # the tests' in-process reference loads while the server starts
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start in {_START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        scheduler_pid = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler_pid"]
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while _process_exists(scheduler_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _process_exists(scheduler_pid), "scheduler process outlived the server"


@pytest.fixture(scope="session")
def client(server_url):
    from openai import OpenAI

    with OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The reference engine of these tests shares the machine's cores with the server's engine: one intra-op
    thread each instead of oversubscribing them."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
