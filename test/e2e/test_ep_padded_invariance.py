"""The capture-safe exchange in batch-invariant mode (CPU, gloo; DEEPINFER_EP_PADDED_DISPATCH=1, see
test_ep_padded_exchange.py): greedy tokens and logprobs of EP=2 (EP=4: a slow variant) bitwise EP=1's. A slow
first step in every worker: the CPU invariant GEMMs check their tile plan once per weight shape and process."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ep_padded_exchange import _run  # noqa: E402


@pytest.mark.parametrize("ep_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_batch_invariant_padded_exchange_is_ep1_bitwise(tiny_v3_path, monkeypatch, ep_size):
    monkeypatch.setenv("DEEPINFER_EP_STEP_TIMEOUT", "180")
    want, _ = _run(tiny_v3_path, monkeypatch, 1, False, batch_invariant=True)
    got, stats = _run(tiny_v3_path, monkeypatch, ep_size, True, batch_invariant=True)
    assert stats["ep_padded_steps"] >= 6, stats
    assert got == want
