"""Overlap scheduling (DEEPINFER_OVERLAP, forced on here on CPU) against the synchronous engine: token- and
text-identical outputs for mixed requests, and no host read in the launch of an overlapped decode step
(test/gpu/test_gpu_overlap.py checks the same on CUDA with the sync debug mode)."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.model_runner import ModelRunner


def _engine(path, overlap: bool, monkeypatch, **kwargs) -> Engine:
    monkeypatch.setenv("DEEPINFER_OVERLAP", "1" if overlap else "0")
    engine = Engine(str(path), dtype="float32", **kwargs)
    assert engine.executor.is_overlap_enabled == overlap
    return engine


def _workload(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    header = [rng.randrange(10, vocab) for _ in range(24)]
    return [header[: rng.randint(0, 24)] + [rng.randrange(10, vocab) for _ in range(rng.randint(3, 30))]
            for _ in range(12)]


def _params(reference: list, seed: int) -> list[SamplingParams]:
    """Mixed params; stop tokens and stop strings taken from a first synchronous run so they really hit."""
    rng = random.Random(seed)
    params = []
    for i, out in enumerate(reference):
        kind = i % 7
        p = SamplingParams(max_new_tokens=rng.randint(4, 16), temperature=0.0)
        if kind == 1:
            p = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=i)
        elif kind == 2 and len(out.token_ids) > 6:
            p = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[out.token_ids[5]])
        elif kind == 3 and len(out.text) > 8:
            p = SamplingParams(max_new_tokens=16, temperature=0.0, stop=[out.text[4:7]])
        elif kind == 4:
            p = SamplingParams(max_new_tokens=12, temperature=0.0, min_new_tokens=5)
        elif kind == 5:
            p = SamplingParams(max_new_tokens=10, temperature=0.7, seed=i, logprobs=True)
        elif kind == 6:
            p = SamplingParams(max_new_tokens=16, temperature=0.0, repetition_penalty=1.3)
        params.append(p)
    return params


def _summary(outs) -> list:
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs is not None) for o in outs]


@pytest.fixture(scope="module")
def mixed_workload(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096) as probe:
        prompts = _workload(probe.model_config.vocab_size, seed=1)
        first = probe.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=16,
                                                                                 temperature=0.0))
    return prompts, _params(first, seed=2)


@pytest.mark.parametrize("kwargs", [
    dict(kv_cache_tokens=4096),
    dict(page_size=4, kv_cache_tokens=112, chunked_prefill_tokens=32, max_num_seqs=8),  # retraction, eviction
])
def test_overlap_outputs_equal_synchronous(tiny_llama_path, mixed_workload, monkeypatch, kwargs):
    prompts, params = mixed_workload
    results = []
    for overlap in (False, True):
        with _engine(tiny_llama_path, overlap, monkeypatch, **kwargs) as engine:
            outs = []
            for i in range(0, len(prompts), 6):  # waves: later ones hit what earlier ones cached
                outs += engine.generate(input_ids=prompts[i : i + 6], sampling_params=params[i : i + 6])
            results.append(_summary(outs))
            assert engine.pool.allocator.num_free + engine.cache.num_cached_pages == engine.pool.allocator.num_pages
            if kwargs["kv_cache_tokens"] < 1000:
                assert engine.stats["num_retractions"] > 0
    assert results[1] == results[0]
    assert {"stop", "length"} <= {r[2] for r in results[0]}


def test_overlap_abort_mid_decode(tiny_llama_path, monkeypatch):
    """Requests joining and aborted mid-decode: the others are unchanged, an aborted one holds a prefix of
    what it would have generated, and every page comes back."""
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        with _engine(tiny_llama_path, overlap, monkeypatch, kv_cache_tokens=2048) as engine:
            prompts = _workload(engine.model_config.vocab_size, seed=3)[:8]
            with engine.hold_loop():  # steps driven here, so the abort lands at a known step
                reqs = [engine.add_request(p, sp)[0] for p in prompts[:5]]
                for k in range(6):
                    engine.step()
                    if k == 2:
                        reqs += [engine.add_request(p, sp)[0] for p in prompts[5:]]
                engine.abort([reqs[1], reqs[6]])
                while engine.scheduler.has_work:
                    engine.step()
            runs.append([r.output_ids for r in reqs])
            assert all(t >= 0 for r in reqs for t in r.token_ids)
            engine.flush_cache()
            assert engine.pool.allocator.num_free == engine.pool.allocator.num_pages
    sync, over = runs
    for k, (a, b) in enumerate(zip(sync, over)):
        if k in (1, 6):
            assert a[: len(b)] == b and len(b) >= len(a) - 1
        else:
            assert a == b


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_overlapped_decode_launch_never_reads_the_device(tiny_llama_path, monkeypatch):
    """The launch of an overlapped decode step (inputs, forward, logits, sampling) must not read a tensor
    back to the host: on a GPU that read waits for the step in flight, and the overlap is gone. On CPU,
    every tensor -> host read is counted outside the model forward and the attention backend's metadata
    (device-specific; CUDA graphs skip both)."""
    with _engine(tiny_llama_path, True, monkeypatch, kv_cache_tokens=4096) as engine:
        reads, exempt = [], [1]  # counting is on only inside the launch
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _original=original, _name=name, **kwargs):
                if not exempt[0]:
                    reads.append(_name)
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

        def exempted(fn):
            def call(*args, **kwargs):
                exempt[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    exempt[0] -= 1
            return call

        monkeypatch.setattr(engine.model, "forward", exempted(engine.model.forward))
        monkeypatch.setattr(engine.executor.backend, "prepare", exempted(engine.executor.backend.prepare))
        launches = [0]
        launch = ModelRunner._launch_overlapped

        def guarded(self, batch, prev):
            exempt[0] -= 1  # the only region counted
            try:
                launches[0] += 1
                return launch(self, batch, prev)
            finally:
                exempt[0] += 1

        monkeypatch.setattr(ModelRunner, "_launch_overlapped", guarded)
        params = [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=1,
                                 ignore_eos=True)]
        engine.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]], sampling_params=params)
    assert launches[0] >= 4
    assert reads == []


class _PrefetchRecorder:
    """Stands in for the CUDA-graph runner on CPU: fits no batch (every step runs eagerly) and records which
    requests the model runner hands to `prefetch_pages`, with their output counts then."""

    def __init__(self):
        self.prefetched: list[tuple[int, int]] = []

    def run(self, batch, input_ids=None, future=None):
        return None

    def prefetch_pages(self, reqs) -> None:
        self.prefetched += [(r.rid, r.num_output_tokens) for r in reqs]


@pytest.mark.parametrize("overlap", [False, True])
def test_page_lists_prefetched_in_the_step_that_ends_prefill(tiny_llama_path, monkeypatch, overlap):
    """Every request is offered to the graph runner's page-table prefetch from the eager step that completes
    its prompt (chunked here), before its first output token: its first graph step then uploads no prompt."""
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    with _engine(tiny_llama_path, overlap, monkeypatch, kv_cache_tokens=4096, chunked_prefill_tokens=16) as engine:
        prompts = _workload(engine.model_config.vocab_size, seed=4)[:6]
        recorder = engine.executor.graphs = _PrefetchRecorder()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
    first = {}
    for rid, num_outputs in recorder.prefetched:
        first.setdefault(rid, num_outputs)
    assert len(first) == len(prompts) and set(first.values()) == {0}
    assert all(len(o.token_ids) == 4 for o in outs)
