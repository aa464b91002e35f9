"""DeepSeek-V4 and V4.1 decode through CUDA graphs (CUDA only): graphs are captured (decode steps of fixed shape,
models/deepseek_v4/graph_batch.py), replayed with no host sync inside a step, and their greedy tokens equal the eager
CUDA steps' and the CPU engine's, over prompts of different lengths crossing the sliding and compression windows,
with pages, chunked prefill and a second round of prefix-cache hits that end mid-window."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _ids(100, 34)
PROMPTS = [_ids(i, n) for i, n in enumerate((1, 3, 7, 12, 17))] + [
    SHARED + _ids(10 + i, n - len(SHARED)) for i, n in enumerate((36, 43, 47))]


@pytest.fixture(scope="module")
def tiny_v4_gpu_path(tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4-graphs"), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


def _guard_replays(engine: Engine, monkeypatch) -> list[int]:
    """Count the decode steps the graphs ran; a host sync inside one raises."""
    graphs, runs = engine.executor.graphs, [0]
    inner = graphs.run

    def run(batch, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = inner(batch, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs[0] += hidden is not None
        return hidden

    monkeypatch.setattr(graphs, "run", run)
    return runs


def _generate(path, device: str, monkeypatch=None, **kwargs):
    kw = {"dtype": "float32", "kv_cache_tokens": 4096, "max_num_seqs": 8, "page_size": 4,
          "chunked_prefill_tokens": 13, **kwargs}
    with Engine(str(path), device=device, **kw) as engine:
        runs = None
        if monkeypatch is not None:
            assert engine.executor.graphs is not None and engine.executor.graphs._graphs, "no graph was captured"
            runs = _guard_replays(engine, monkeypatch)
        first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        extended = [p + o.token_ids[:3] for p, o in zip(PROMPTS, first)]  # hits that end mid-window
        second = engine.generate(input_ids=extended, sampling_params=GREEDY)
        assert sum(o.cached_tokens for o in second) > 0
    return first + second, runs


def _check(path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_V4_CUDA_GRAPHS", "1")
    ref, _ = _generate(path, "cpu")
    graphed, runs = _generate(path, "cuda", monkeypatch)
    assert runs[0] > 0
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "0")
    eager, _ = _generate(path, "cuda")
    for g, e, r in zip(graphed, eager, ref):
        assert g.token_ids == e.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-3
        assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < 2e-2


def test_v4_decode_graphs_match_eager_and_cpu(tiny_v4_gpu_path, monkeypatch):
    _check(tiny_v4_gpu_path, monkeypatch)


@pytest.mark.parametrize("variant", ["a", "b"])
def test_v41_decode_graphs_match_eager_and_cpu(tiny_v41_paths, variant, monkeypatch):
    _check(tiny_v41_paths[variant], monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs SM90+")
@pytest.mark.parametrize("graphs", [False, True])
def test_v4_dependent_launches_are_bitwise_the_same(tiny_v4_gpu_path, graphs, monkeypatch):
    """DEEPINFER_GPU_PDL: V4's kernels (norms, rotation, hyper-connections, Sinkhorn, pooling, indexer, sparse
    attention, routing, the slot sums) launch as programmatic dependent launches and wait first thing; tokens and
    logprobs are bitwise those of ordinary launches, eager and through graphs, bf16."""
    from deepinfer_rt.models.deepseek_v4.methods import V4TritonMethod

    monkeypatch.setenv("DEEPINFER_V4_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "8" if graphs else "0")
    outs = {}
    for pdl in (True, False):
        monkeypatch.setenv("DEEPINFER_GPU_PDL", "1" if pdl else "0")
        with Engine(str(tiny_v4_gpu_path), device="cuda", dtype="bfloat16", kv_cache_tokens=4096, max_num_seqs=8,
                    page_size=4, chunked_prefill_tokens=13) as engine:
            methods = {m.method for m in engine.model.modules() if isinstance(getattr(m, "method", None),
                                                                             V4TritonMethod)}
            assert methods and all(m.pdl == pdl for m in methods)
            outs[pdl] = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
