"""Helpers of the server tests: server statistics and waiting for the server to be idle."""
from __future__ import annotations

import time

import httpx


def server_info(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()


def wait_idle(url: str, timeout_s: float = 30.0) -> dict:
    """Server info once no sequence is in flight anywhere (HTTP process and scheduler)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server_info(url)
        if info["num_inflight_seqs"] == 0 and info["num_running"] == 0 and info["num_waiting"] == 0:
            return info
        assert time.monotonic() < deadline, f"server not idle after {timeout_s} s: {info}"
        time.sleep(0.05)


def start_server(model: str, log_path, env: dict | None = None, timeout_s: float = 180.0, extra_args=()):
    """A `deepinfer serve` process of its own (for tests that kill or stop its engine): (process, url)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "deepinfer_rt.cli", "serve", "--model", str(model), "--port", str(port),
           "--dtype", "float32", *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "DEEPINFER_NUM_THREADS": "1", **(env or {})},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{Path(log_path).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise AssertionError(f"server did not start in {timeout_s} s:\n{Path(log_path).read_text()[-3000:]}")
        time.sleep(0.3)


def stop_server(proc) -> None:
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
