"""The capture-safe exchange in EP worker pools (CPU, gloo; DEEPINFER_EP_PADDED_DISPATCH=1 runs it for every
agreed decode step, as CUDA graphs do on GPUs, eagerly here), tiny DeepSeek-V3 (fp32): greedy tokens and logprobs
equal the exact exchange's bitwise at EP=2, and EP=1's at EP=2 and EP=4 (batch-invariant mode:
test_ep_padded_invariance.py); a capacity too small for
the routing: test_ep_failures.py).
Requests of different lengths finish at different steps, so decode steps meet ranks with fewer rows than others
and ranks with none (empty steps through the same exchange)."""
from __future__ import annotations

import pytest

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "def f(x):\n    return",
           "A long time ago in a galaxy far, far away", "?"]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True) for n in (7, 3, 6, 1, 5, 8)]


def _run(path, monkeypatch, ep_size: int, padded: bool, **kwargs):
    monkeypatch.setenv("DEEPINFER_EP_PADDED_DISPATCH", "1" if padded else "0")
    with Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=2048, ep_size=ep_size,
                enable_prefix_cache=False, **kwargs) as engine:
        outs = engine.generate(PROMPTS, sampling_params=PARAMS)
        stats = engine.stats
    return [(o.token_ids, o.logprobs) for o in outs], stats


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    with pytest.MonkeyPatch.context() as mp:
        return _run(tiny_v3_path, mp, 1, False)[0]


def _close(got, want, tol: float) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb)) < tol


def test_ep2_padded_exchange_is_the_exact_one_bitwise(tiny_v3_path, monkeypatch, reference):
    exact, exact_stats = _run(tiny_v3_path, monkeypatch, 2, False)
    padded, stats = _run(tiny_v3_path, monkeypatch, 2, True)
    assert exact_stats["ep_padded_steps"] == 0
    assert stats["ep_padded_steps"] >= 6, stats  # every decode step (7 of them) but the prefill
    assert padded == exact
    _close(padded, reference, 1e-5)


@pytest.mark.slow  # EP=2 runs by default (above)
def test_ep4_padded_exchange_matches_ep1(tiny_v3_path, monkeypatch, reference):
    padded, stats = _run(tiny_v3_path, monkeypatch, 4, True)
    assert stats["ep_padded_steps"] >= 6, stats
    _close(padded, reference, 1e-5)

