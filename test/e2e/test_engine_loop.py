"""The engine's one loop, with a mock model (no forward: a fake executor samples a known token per position) and
then with real ones: concurrent callers share steps, an error fails only its own requests, a dead loop makes
every waiting caller raise, overlapped steps give the synchronous tokens."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import deepinfer_lang as sgl
from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.model_runner import Launched, RunResult
from deepinfer_rt.sampler import SampleResult


def fake_token(req, position: int) -> int:
    """The token the mock model samples after `position` tokens of `req` (a function of its prompt only)."""
    return 10 + (sum(req.prompt_ids) * 7 + position * 13) % 200


class MockExecutor:
    """Stands in for the model runner: same allocator, no model. Optionally overlapped (tokens collected one
    step late, like the GPU path); `fail_on` makes the launch of a batch holding that request id raise."""

    def __init__(self, runner, overlap: bool = False):
        self.inner = runner
        self.allocator, self.page_size, self.num_slots = runner.allocator, runner.page_size, runner.num_slots
        self.is_overlap = overlap
        self.fail_on: int | None = None
        self.batch_sizes: list[int] = []
        self.grammar = None

    def can_overlap(self, batch) -> bool:
        return self.is_overlap and all(it.num_new_tokens == 1 and it.is_sampling for it in batch.items) \
            and bool(batch.items)

    def launch(self, batch, prev=None):
        if self.fail_on is not None and any(it.req.rid == self.fail_on for it in batch.items):
            raise RuntimeError("device fault (mock)")
        self.batch_sizes.append(len(batch.items))
        tokens = [fake_token(it.req, it.start + it.num_new_tokens) for it in batch.items if it.is_sampling]
        rows = [i for i, it in enumerate(batch.items) if it.is_sampling]
        return Launched(result=RunResult(list(zip(rows, tokens)), SampleResult(tokens, None, None), {}))

    def collect(self, handle):
        return handle.result

    def run(self, batch):
        return self.collect(self.launch(batch))

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.inner.shutdown()


def expected(prompt: list[int], n: int) -> list[int]:
    class R:
        prompt_ids = prompt
    return [fake_token(R, len(prompt) + k) for k in range(n)]


@pytest.fixture
def mock_engine(tiny_llama_path):
    def make(overlap: bool = False, **kwargs):
        engine = Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=kwargs.pop("kv", 4096), **kwargs)
        engine.executor = MockExecutor(engine.executor, overlap)
        engine.scheduler.pool = engine.executor
        return engine
    return make


PROMPTS = [[3 + i, 5, 7 + 2 * i, 11] for i in range(12)]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_mock_model_outputs_and_shared_steps(mock_engine, overlap):
    with mock_engine(overlap) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [expected(p, 24) for p in PROMPTS]
        assert engine.stats["num_free_pages"] + engine.stats["num_cached_pages"] == engine.stats["num_pages"]
        one_call = engine.num_steps
        results = [None] * len(PROMPTS)

        def call(i):
            results[i] = engine.generate(input_ids=[PROMPTS[i]], sampling_params=GREEDY)[0].token_ids
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
        # A mock step takes microseconds, far less than starting a thread: hold the loop until every caller
        # has submitted, so the test measures sharing, not thread start-up (the real-model test below races).
        with engine.hold_loop():
            for t in threads:
                t.start()
            while len(engine._loop._inbox) < len(PROMPTS):
                time.sleep(0.001)
        for t in threads:
            t.join()
        assert results == [expected(p, 24) for p in PROMPTS]
        assert engine.num_steps - one_call <= 1.2 * one_call


def test_failed_step_fails_its_requests_and_the_loop_goes_on(mock_engine):
    with mock_engine() as engine:
        with engine.hold_loop():
            bad = engine.add_request(PROMPTS[0], GREEDY)[0]
            engine.executor.fail_on = bad.rid
        out = engine.generate(input_ids=[PROMPTS[1]], sampling_params=GREEDY)  # admitted with bad: fails too
        assert bad.finish_reason == "error" and "device fault" in bad.error
        assert out[0].finish_reason == "error"
        engine.executor.fail_on = None
        again = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)
        assert [o.token_ids for o in again] == [expected(p, 24) for p in PROMPTS[:3]]
        assert engine.stats["num_free_pages"] + engine.stats["num_cached_pages"] == engine.stats["num_pages"]


def test_request_whose_output_fails_finishes_alone(mock_engine):
    with mock_engine() as engine:
        outs_ok = engine.generate(input_ids=PROMPTS[1:4], sampling_params=GREEDY)
        with engine.hold_loop():
            reqs = [engine.add_request(p, GREEDY)[0] for p in PROMPTS[:4]]

            def broken(*args, **kwargs):
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "mock detokenizer fault")
            reqs[0].detokenizer.add = broken
            reqs[0].detokenizer.push = broken
            reqs[0].detokenizer.catch_up = broken  # the decode of a request without stop strings
        engine._loop.wait(lambda: all(r.is_finished for r in reqs))
        assert reqs[0].finish_reason == "error" and "mock detokenizer fault" in reqs[0].error
        assert [r.output_ids for r in reqs[1:]] == [o.token_ids for o in outs_ok]


def test_dead_loop_makes_waiting_callers_raise(mock_engine):
    engine = mock_engine()
    try:
        def dead():
            raise SystemError("loop fault (mock)")
        engine._loop._has_work = lambda: dead  # the loop's own bookkeeping fails: the thread dies
        with pytest.raises(RuntimeError, match="engine loop died"):
            engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)
        with pytest.raises(RuntimeError, match="engine loop died"):
            engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    finally:
        engine._loop.close()


def test_manual_step_outside_hold_is_refused(mock_engine):
    with mock_engine() as engine:
        engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)  # the loop thread runs now
        with pytest.raises(RuntimeError, match="hold_loop"):
            engine.step()


# ---- real models ----
CONCURRENT = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def invariant_engine(tiny_llama_path):
    # Batch-invariant: a request's tokens do not depend on what shares its steps, so they must be identical.
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=8192, batch_invariant=True) as engine:
        yield engine


def test_threads_and_tasks_batch_like_one_call(invariant_engine):
    engine = invariant_engine
    engine.flush_cache()
    before = engine.num_steps
    ref = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=CONCURRENT)]
    one_call = engine.num_steps - before

    engine.flush_cache()
    results = [None] * len(PROMPTS)

    def call(i):
        results[i] = engine.generate(input_ids=[PROMPTS[i]], sampling_params=CONCURRENT)[0].token_ids
    before = engine.num_steps
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threaded = engine.num_steps - before
    assert results == ref
    assert threaded <= 1.2 * one_call, (threaded, one_call)

    engine.flush_cache()

    async def tasks():
        return await asyncio.gather(*[engine.async_generate(input_ids=[p], sampling_params=CONCURRENT)
                                      for p in PROMPTS])
    before = engine.num_steps
    outs = asyncio.run(tasks())
    assert [o[0].token_ids for o in outs] == ref
    assert engine.num_steps - before <= 1.2 * one_call


def test_streams_from_threads_share_steps(invariant_engine):
    engine = invariant_engine
    ref = [o.text for o in engine.generate(input_ids=PROMPTS[:6], sampling_params=CONCURRENT)]
    texts = [None] * 6

    def call(i):
        texts[i] = "".join(engine.stream(input_ids=PROMPTS[i], sampling_params=CONCURRENT))
    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert texts == ref


def test_run_batch_programs_share_steps(tiny_llama_path):
    @sgl.function
    def program(s, question):
        s += question
        s += sgl.gen("answer", max_tokens=16, temperature=0, ignore_eos=True)

    runtime = sgl.Runtime(model=str(tiny_llama_path), dtype="float32", kv_cache_tokens=8192)
    try:
        sizes = []
        launch = runtime.engine.executor.launch

        def recorded(batch, prev=None):
            sizes.append(len(batch.items))
            return launch(batch, prev)
        runtime.engine.executor.launch = recorded
        states = program.run_batch([{"question": f"Question {i}: what is {i} + {i}?"} for i in range(16)],
                                   backend=runtime, num_threads=16)
        assert all(len(s["answer"]) > 0 for s in states)
        assert sorted(sizes)[len(sizes) // 2] >= 8, sizes  # most steps batch at least 8 programs
    finally:
        runtime.shutdown()
