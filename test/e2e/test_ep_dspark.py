"""DSpark (speculative="dspark") drafted in the EP workers (CPU, gloo; the tiny V4.1 config 'a' with DSpark stages):
each rank captures its own rows' target features, keeps its requests' context keys in its own pool and drafts for
them after each verify step, its draft expert bank whole (distributed/spec.py). Fixed-length drafts make the drafted
and accepted counts a function of the tokens alone, so EP=1 and EP=2 must give the in-process engine's tokens and
counts; confidence-scheduled drafts (whose lengths follow measured step times) the tokens of no speculation.
Retraction and batch-invariant mode: test_ep_dspark_modes.py."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(i, n) for i, n in enumerate((1, 6, 13, 29))]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PARAMS = [GREEDY, SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True), GREEDY, GREEDY]
FIXED = SpeculativeConfig("dspark", fixed_length=True)
GREEDY_ROWS = [i for i, p in enumerate(PARAMS) if p.is_greedy]


def _run(path, speculative=None, ep_size=None, params=PARAMS, **kwargs):
    """Tokens, the engine's speculation counts and the requests each EP rank served (None in process)."""
    kwargs = dict(dict(dtype="float32", kv_cache_tokens=2048, max_num_seqs=8), **kwargs)
    if ep_size is not None:
        kwargs["ep_size"] = ep_size
    with Engine(str(path), speculative=speculative, **kwargs) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
        served = list(engine.scheduler.num_served) if ep_size is not None and ep_size > 1 else None
        stats = dict(engine.stats.get("spec", {}), num_retractions=engine.stats.get("num_retractions"))
        return [o.token_ids for o in outs], stats, served


@pytest.fixture(scope="module")
def in_process(dspark_v41_path):
    plain, _, _ = _run(dspark_v41_path)
    tokens, stats, _ = _run(dspark_v41_path, FIXED)
    assert [tokens[i] for i in GREEDY_ROWS] == [plain[i] for i in GREEDY_ROWS]
    assert 0 < stats["accepted"] < stats["drafted"], stats
    return plain, tokens, stats


@pytest.mark.parametrize("ep_size", [pytest.param(1, marks=pytest.mark.slow), 2])  # EP=1: -m slow
def test_dspark_under_ep_equals_dspark_in_process(dspark_v41_path, in_process, monkeypatch, ep_size):
    """Greedy requests give the tokens of no speculation and the seeded sampled one (rejection sampling against
    the worker's own draft distribution) those of in-process DSpark; drafted and accepted counts are the
    in-process engine's. At EP=2 the requests spread over both ranks."""
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    _, tokens, stats = in_process
    outs, ep_stats, served = _run(dspark_v41_path, FIXED, ep_size=ep_size)
    assert outs == tokens
    assert ep_stats == stats
    if ep_size == 2:
        assert all(served), served


def test_dspark_confidence_scheduled_under_ep(dspark_v41_path, in_process):
    """The planner picks draft lengths from the shipped confidences (and its step times): greedy tokens are those
    of no speculation, and drafts are verified."""
    plain = in_process[0]
    outs, stats, served = _run(dspark_v41_path, "dspark", ep_size=2)
    assert [outs[i] for i in GREEDY_ROWS] == [plain[i] for i in GREEDY_ROWS]
    assert stats["drafted"] > 0 and all(served), (stats, served)


def test_dspark_refusals_before_workers_start(tiny_v3_path, monkeypatch):
    with pytest.raises(ValueError, match="speculative='dspark' needs a DeepSeek-V4.1 model"):
        Engine(str(tiny_v3_path), dtype="float32", ep_size=2, speculative="dspark")
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    with pytest.raises(ValueError, match="needs a DeepSeek-V4.1 model"):
        Engine(str(tiny_v3_path), dtype="float32", ep_size=1, speculative="dspark")


def test_dspark_without_drafter_layers_is_refused_before_workers_start(tiny_v41_paths):
    with pytest.raises(ValueError, match="needs a DeepSeek-V4.1 checkpoint with DSpark layers"):
        Engine(str(tiny_v41_paths["a"]), dtype="float32", ep_size=2, speculative="dspark")


def test_a_drafter_object_reading_the_target_is_refused_before_workers_start(tiny_v3_path):
    """A drafter object with KV layers of its own (as DSparkDrafter has) cannot run there: its state would be the
    engine's, the target's stays in the workers."""
    from deepinfer_rt.speculative.drafter import Drafter

    class KeyedDrafter(Drafter):
        num_kv_layers = 1

        def propose(self, req, k):
            return None

    with pytest.raises(ValueError, match="the drafter KeyedDrafter reads the target model's state"):
        Engine(str(tiny_v3_path), dtype="float32", ep_size=2, speculative=SpeculativeConfig(drafter=KeyedDrafter()))
