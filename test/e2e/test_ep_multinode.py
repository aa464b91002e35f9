"""Multi-node start on loopback (CPU, gloo): "node 0" is the engine with its local rank 0 (the rendezvous at the
MASTER_ADDR / MASTER_PORT it is given), "node 1" is torchrun starting rank 1 with --first-rank. The tokens match
the single-process engine, and torchrun's worker exits once the engine shuts down. A worker whose rank or
WORLD_SIZE does not fit the engine's EP group is refused with a clear message."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(path, **kwargs) -> Engine:
    return Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=1024, **kwargs)


def test_two_nodes_on_loopback_torchrun_second_node(tiny_v3_path, monkeypatch):
    with _engine(tiny_v3_path) as engine:
        reference = [o.token_ids for o in engine.generate(PROMPTS, sampling_params=GREEDY)]
    engine_port, master_port = _free_port(), _free_port()
    for name, value in [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(master_port)),
                        ("DEEPINFER_EP_PORT", str(engine_port)), ("DEEPINFER_EP_LOCAL_WORKERS", "1")]:
        monkeypatch.setenv(name, value)
    # torchrun's own rendezvous (its agent store) on another port: the worker joins the engine's instead.
    node1 = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
         "--master-port", str(_free_port()), "-m", "deepinfer_rt.distributed.worker", "--first-rank", "1",
         f"tcp://127.0.0.1:{engine_port}"],
        env={k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")})
    try:
        with _engine(tiny_v3_path, ep_size=2) as engine:
            assert len(engine.executor.pids) == 1
            outs = engine.generate(PROMPTS, sampling_params=GREEDY)
            served = engine.scheduler.num_served
        assert [o.token_ids for o in outs] == reference
        assert all(served), served  # both nodes served requests
        assert node1.wait(timeout=30) == 0  # the engine's shutdown stopped it, and torchrun with it
    finally:
        node1.kill()


@pytest.mark.parametrize("env, message", [
    ({"RANK": "5", "LOCAL_RANK": "0"}, "rank 5 is outside the EP group of 2 ranks"),
    ({"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, "WORLD_SIZE=4 but the engine runs ep_size=2"),
])
def test_a_worker_that_does_not_fit_is_refused(tiny_v3_path, monkeypatch, env, message):
    port = _free_port()
    monkeypatch.setenv("DEEPINFER_EP_PORT", str(port))
    monkeypatch.setenv("DEEPINFER_EP_LOCAL_WORKERS", "1")
    monkeypatch.setenv("DEEPINFER_EP_START_TIMEOUT", "8")
    stray = subprocess.Popen([sys.executable, "-m", "deepinfer_rt.distributed.worker", f"tcp://127.0.0.1:{port}"],
                             env=dict(os.environ, **env), stderr=subprocess.PIPE, text=True)
    try:
        # The refused worker exits; the engine, missing its rank 1 (rank 0 waits for it in the rendezvous),
        # fails to start within its start timeout and says whom it refused.
        with pytest.raises(RuntimeError, match=r"worker\(s\) \[(0, )?1\] did not answer within 8 s.*refused: "
                                               + re.escape(message)):
            _engine(tiny_v3_path, ep_size=2)
        _, err = stray.communicate(timeout=30)
        assert stray.returncode != 0 and message in err, err[-2000:]
    finally:
        stray.kill()
