"""EP worker processes seen from a user's script (CPU, gloo): workers are `python -m` processes, so a script
without an `if __name__ == "__main__":` guard runs ep_size=2 (nothing re-imports it), its workers are gone once
it exits, and they go when the engine process is killed outright."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12"]
NEW_TOKENS = 6
_ENGINE = 'Engine({path!r}, ep_size=2, device="cpu", dtype="float32", page_size=4, kv_cache_tokens=1024)'


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    return script


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie left to whoever reaps orphans."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(map(_gone, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_unguarded_script_runs_ep2_and_matches_ep1(tiny_v3_path, tmp_path):
    # No __main__ guard and no shutdown: the pool's finalizer stops the workers when the interpreter exits.
    script = _script(tmp_path, f"""
        import json
        from deepinfer_rt import Engine, SamplingParams

        engine = {_ENGINE.format(path=str(tiny_v3_path))}
        params = SamplingParams(max_new_tokens={NEW_TOKENS}, temperature=0, ignore_eos=True)
        outs = engine.generate({PROMPTS!r}, sampling_params=params)
        print(json.dumps({{"tokens": [o.token_ids for o in outs], "pids": engine.executor.pids}}))
    """)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = done.stdout.splitlines()  # workers write to stderr, never into the script's stdout
    got = json.loads(line)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with Engine(str(tiny_v3_path), dtype="float32", page_size=4, kv_cache_tokens=1024) as engine:
        ref = [o.token_ids for o in engine.generate(PROMPTS, sampling_params=params)]
    assert got["tokens"] == ref
    assert len(got["pids"]) == 2 and _wait_gone(got["pids"], 5)


def test_workers_exit_when_the_engine_process_is_killed(tiny_v3_path, tmp_path):
    script = _script(tmp_path, f"""
        import sys, time
        from deepinfer_rt import Engine

        engine = {_ENGINE.format(path=str(tiny_v3_path))}
        print(*engine.executor.pids, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, "the script died before its engine was up"
        assert not any(map(_gone, pids))
        os.kill(proc.pid, signal.SIGKILL)  # no finalizer runs: the workers notice their parent is gone
        proc.wait(10)
        assert _wait_gone(pids, 5), "a worker outlived its engine"
    finally:
        proc.kill()
        proc.wait(10)
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
