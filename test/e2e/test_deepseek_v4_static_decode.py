"""DeepSeek-V4 and V4.1 decode steps of fixed shape (models/deepseek_v4/graph_batch.py), run through the CUDA-graph
runner uncaptured on the CPU (cuda_graph.py is_captured=False): the same greedy tokens and logprobs (fp32) as the
eager steps over prompts of different lengths crossing sliding and compression windows, with pages, prefix-cache
hits mid-window and retraction; and a fixed-shape step reads nothing back to the host (outside the CPU expert loop,
which CUDA replaces by the fused MoE kernel)."""
from __future__ import annotations

import traceback

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.cuda_graph import CudaGraphRunner

MAX_NEW = 9
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logprobs=True, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(100, 34)
PROMPTS = [_ids(i, n) for i, n in enumerate((1, 3, 7, 12, 17))] + [
    SHARED + _ids(10 + i, n - len(SHARED)) for i, n in enumerate((36, 43, 47))]


def use_static_decode(engine: Engine, batch_sizes=(1, 2, 4, 8), head: bool = False) -> CudaGraphRunner:
    """Give the engine's runner an uncaptured graph runner (before its first step): every decode batch that fits
    then runs as a fixed-shape step (`head`: the logits and argmax inside it, as the engine's CUDA graphs)."""
    runner = engine.executor
    graphs = CudaGraphRunner(engine.model, engine.pool, None, max(batch_sizes), engine.model_config.max_position,
                             batch_sizes=batch_sizes, num_rows=runner.pages.table.shape[0], is_captured=False,
                             **(dict(head=engine.model.compute_logits, vocab_size=engine.sampler.vocab_size)
                                if head else {}))
    runner.graphs, runner.pages = graphs, graphs.pages
    return graphs


def _run(path, static: bool, rounds: int = 1, **kwargs):
    kw = {"dtype": "float32", "kv_cache_tokens": 2048, "max_num_seqs": 8, **kwargs}
    with Engine(str(path), **kw) as engine:
        graphs = use_static_decode(engine) if static else None
        outs = [engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        if rounds == 2:  # prompts extended by 3 of their tokens: prefix hits that end mid-window
            extended = [p + o.token_ids[:3] for p, o in zip(PROMPTS, outs[0])]
            outs.append(engine.generate(input_ids=extended, sampling_params=GREEDY))
        stats = {"retractions": engine.scheduler.num_retractions,
                 "replays": graphs.num_replays if graphs else 0,
                 "cached": sum(o.cached_tokens for r in outs for o in r)}
    return outs, stats


def _check_same(path, **kwargs):
    want, _ = _run(path, static=False, **kwargs)
    got, stats = _run(path, static=True, **kwargs)
    assert stats["replays"] > 0
    for w_round, g_round in zip(want, got):
        for w, g in zip(w_round, g_round):
            assert g.token_ids == w.token_ids
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
    return stats


@pytest.mark.parametrize("page_size", [1, 4])
def test_v4_static_decode_equals_eager(tiny_v4_path, page_size):
    _check_same(tiny_v4_path, page_size=page_size, chunked_prefill_tokens=13)


def test_v4_static_decode_with_prefix_hits_and_retraction(tiny_v4_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_V4_CHECKPOINT_TOKENS", "12")
    stats = _check_same(tiny_v4_path, rounds=2, page_size=4, chunked_prefill_tokens=20)
    assert stats["cached"] > 100
    stats = _check_same(tiny_v4_path, kv_cache_tokens=120, chunked_prefill_tokens=32)
    assert stats["retractions"] > 0


def _mixed_params(n: int) -> list[SamplingParams]:
    """Greedy rows (the graph's argmax), sampled rows (the sampler over the graph's logits), a logit bias and
    logprobs (a synchronous step over the graph's logits)."""
    kinds = [GREEDY_PLAIN, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
             SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, logit_bias={105: 3.0}, ignore_eos=True),
             GREEDY]
    return [kinds[i % len(kinds)] for i in range(n)]


GREEDY_PLAIN = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_v4_graph_head_and_page_appends_under_overlap_equal_eager(tiny_v4_path, monkeypatch, page_size):
    """The graph step with the head inside (logits, each row's token, placeholders resolved and the new page written
    in the graph), overlap scheduling on: the same tokens and logprobs as eager synchronous steps; a wave of plain
    greedy requests, and one of greedy and plain temperature requests (the graph's draws at their staged
    temperatures and stream seeds), sample nothing on the host."""
    drawn = [GREEDY_PLAIN, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, seed=5, ignore_eos=True),
             SamplingParams(max_new_tokens=MAX_NEW, temperature=1.3, seed=6, ignore_eos=True)]
    waves = [(PROMPTS, [GREEDY_PLAIN] * len(PROMPTS)), (PROMPTS[::-1], _mixed_params(len(PROMPTS))),
             (PROMPTS, [drawn[i % 3] for i in range(len(PROMPTS))])]
    outs = {}
    for static in (False, True):
        monkeypatch.setenv("DEEPINFER_OVERLAP", "1" if static else "0")
        with Engine(str(tiny_v4_path), dtype="float32", kv_cache_tokens=2048, max_num_seqs=8,
                    page_size=page_size) as engine:
            assert engine.executor.is_overlap_enabled == static
            graphs = use_static_decode(engine, head=True) if static else None
            samples = []
            sample = engine.sampler.sample
            engine.sampler.sample = lambda *a, **k: samples.append(1) or sample(*a, **k)
            got = []
            for i, (prompts, params) in enumerate(waves):
                samples.clear()
                got.append(engine.generate(input_ids=prompts, sampling_params=params))
                if static and i != 1:
                    assert graphs.num_replays > 0 and samples == []  # every decode step took the graph's tokens
        outs[static] = got
    assert len({tuple(o.token_ids) for o in outs[True][2]}) > 3  # the temperature rows drew their own tokens
    for want_wave, got_wave in zip(outs[False], outs[True]):
        for w, g in zip(want_wave, got_wave):
            assert g.token_ids == w.token_ids
            if w.logprobs is not None:
                assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4


@pytest.mark.parametrize("variant", ["a", "b"])
def test_v41_static_decode_equals_eager(tiny_v41_paths, variant):
    _check_same(tiny_v41_paths[variant], page_size=4 if variant == "a" else 1, chunked_prefill_tokens=11)


def test_v41_fp8_static_decode_equals_eager(tiny_v41_paths):
    """The FP8 compact pool (kv_cache_dtype='fp8_e4m3'): fixed-shape steps quantize and read its rows as eager ones."""
    _check_same(tiny_v41_paths["a"], page_size=4, chunked_prefill_tokens=11, kv_cache_dtype="fp8_e4m3")


def test_v41_static_decode_with_prefix_hits_and_retraction(tiny_v41_paths):
    stats = _check_same(tiny_v41_paths["a"], rounds=2, chunked_prefill_tokens=20)
    assert stats["cached"] > 100
    stats = _check_same(tiny_v41_paths["a"], kv_cache_tokens=120, chunked_prefill_tokens=32)
    assert stats["retractions"] > 0


_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _HostReadLog:
    """Patches the Tensor methods that read a value back to the host: each call inside the block is logged with
    the innermost deepinfer frame that made it."""

    def __init__(self):
        self.calls: list[str] = []
        self.monkeypatch = pytest.MonkeyPatch()

    def install(self):
        for name in _HOST_READS:
            inner = getattr(torch.Tensor, name)

            def read(t, *args, _inner=inner, _name=name, **kwargs):
                frames = [f for f in traceback.extract_stack()[:-1] if "deepinfer" in f.filename]
                self.calls.append(f"{_name} at {frames[-1].filename}:{frames[-1].lineno}" if frames else _name)
                return _inner(t, *args, **kwargs)

            self.monkeypatch.setattr(torch.Tensor, name, read)

    def uninstall(self):
        self.monkeypatch.undo()


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_static_decode_step_reads_nothing_back(kind, tiny_v4_path, tiny_v41_paths):
    path = tiny_v4_path if kind == "v4" else tiny_v41_paths["a"]
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, max_num_seqs=8, page_size=4) as engine:
        graphs = use_static_decode(engine)
        log, model, steps = _HostReadLog(), engine.model, [0]
        forward = model.forward

        def guarded(batch):
            if not any(batch is fb for fb in graphs._graphs.values()):
                return forward(batch)  # an eager step
            steps[0] += 1
            log.install()
            try:
                return forward(batch)
            finally:
                log.uninstall()

        model.forward = guarded
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert steps[0] > 0
    assert any("moe.py" in c for c in log.calls)  # the guard is live: it sees the CPU expert loop's counts
    outside_moe = [c for c in log.calls if "moe.py" not in c]
    assert outside_moe == [], outside_moe[:5]
