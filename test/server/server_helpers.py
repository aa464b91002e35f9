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
