"""TokenizerManager admission in isolation (no engine process): a request that fails on its way to the engine
gives back every sequence it counted, and a request that can never fit is a ValueError (400), not Overloaded."""
from __future__ import annotations

import asyncio

import pytest

from deepinfer_rt import SamplingParams
from deepinfer_rt.server.io_struct import GenerateReqInput, ReadyMessage
from deepinfer_rt.server.tokenizer_manager import EngineUnavailable, Overloaded, TokenizerManager


@pytest.fixture
def manager(smollm2_path, tmp_path):
    async def make():
        tm = TokenizerManager(str(smollm2_path), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", max_queued_seqs=4)
        tm.info = ReadyMessage(str(smollm2_path), max_position=64, vocab_size=100, eos_ids=(0,), max_num_seqs=4,
                               enable_prefix_cache=True)
        tm.max_inflight_seqs = 8
        tm.is_ready = True
        tm.last_heartbeat = float("inf")
        return tm

    tm = asyncio.run(make())
    yield tm
    tm.shutdown()


def test_a_send_that_fails_midway_releases_everything(manager):
    sent = []

    def send(msg):
        if isinstance(msg, GenerateReqInput) and len([m for m in sent if isinstance(m, GenerateReqInput)]) == 1:
            raise RecursionError("maximum recursion depth exceeded while pickling an object")
        sent.append(msg)

    manager.send = send
    with pytest.raises(RecursionError):
        manager.submit([[1, 2], [3, 4], [5]], SamplingParams(max_new_tokens=2, n=2))
    assert manager.num_inflight_seqs == 0 and not manager.streams
    assert [type(m).__name__ for m in sent] == ["GenerateReqInput", "AbortReq", "AbortReq", "AbortReq"]


@pytest.mark.parametrize("prompts,params,error", [
    ([[1, 2]], SamplingParams(max_new_tokens=2, n=9), ValueError),  # 9 > 8 can never fit
    ([[1, 2]] * 3, SamplingParams(max_new_tokens=2, n=3), ValueError),
    ([[1, 200]], SamplingParams(max_new_tokens=2), ValueError),  # beyond the vocabulary
    ([[1] * 60], SamplingParams(max_new_tokens=5), ValueError),  # beyond the context
    ([[1]], SamplingParams(max_new_tokens=2, stop_token_ids=5), ValueError),
])
def test_refusals_count_nothing(manager, prompts, params, error):
    manager.send = lambda msg: None
    with pytest.raises(error):
        manager.submit(prompts, params)
    assert manager.num_inflight_seqs == 0 and not manager.streams


def test_overloaded_only_when_it_could_fit_later_and_unavailable_when_silent(manager):
    manager.send = lambda msg: None
    first = manager.submit([[1, 2]], SamplingParams(max_new_tokens=2, n=6))
    with pytest.raises(Overloaded):
        manager.submit([[1, 2]], SamplingParams(max_new_tokens=2, n=3))
    first.close()
    assert manager.num_inflight_seqs == 0
    manager.last_heartbeat = 0.0  # silent for longer than the heartbeat timeout
    with pytest.raises(EngineUnavailable, match="not responding"):
        manager.submit([[1, 2]], SamplingParams(max_new_tokens=2))
