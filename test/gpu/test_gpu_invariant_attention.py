"""Batch-invariant attention on CUDA (skipped without a GPU): the fixed-split kernel gives a row bitwise the same
result alone and inside batches of any size, grid split count and launch chunking, close to its reference; the
backend gives a token the same row in prefill, in chunks and in decode; the engine in batch-invariant mode
replays CUDA graphs and a needle's outputs are the same with graphs on or off, in any batch and chunking."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_kernels import decode_attention as da
from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
SHAPES = {"mla-v2": (16, 1, 576, 512), "mla-tiny": (4, 1, 40, 32), "gqa-smollm2": (9, 3, 64, 64)}
"""(query heads, KV heads, K dim, V dim)."""


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _kv(shape, num_slots: int, dtype, gen):
    _, hkv, dk, dv = shape
    k = torch.randn(num_slots, hkv, dk, device=DEV, generator=gen).to(dtype)
    v = k[..., :dv] if hkv == 1 else torch.randn(num_slots, hkv, dv, device=DEV, generator=gen).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_fixed_split_rows_invariant_and_close(shape, page_size, dtype, monkeypatch):
    hq, _, dk, _ = shape
    gen = torch.Generator(device=DEV).manual_seed(page_size)
    capacity = 3008
    width = capacity // page_size
    k, v = _kv(shape, 8 * capacity, dtype, gen)
    table = torch.randperm(8 * width, device=DEV, generator=gen).view(8, width).to(torch.int32)
    rows = torch.arange(8, dtype=torch.int32, device=DEV)
    lens = torch.tensor([3000, 0, 1, 256, 257, 600, 1000, 77], dtype=torch.int32, device=DEV)
    q = torch.randn(8, hq, dk, device=DEV, generator=gen).to(dtype)
    splits = da.fixed_num_splits(capacity)

    def run(q, r, n, s):
        return da.paged_decode_attention_fixed(q, k, v, table, r, n, page_size, dk**-0.5, s)

    alone = torch.cat([run(q[i : i + 1], rows[i : i + 1], lens[i : i + 1], splits) for i in range(8)])
    ref = da.paged_decode_attention_ref(q, k, v, table, rows, lens, page_size, dk**-0.5)
    assert _rel_err(alone, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert (alone[1] == 0).all()
    for extra, more_splits, part_bytes in [(0, 0, 1 << 28), (24, 3, 1 << 28), (200, 17, 1 << 28), (30, 1, 1)]:
        monkeypatch.setattr(da, "_FIXED_PART_BYTES", part_bytes)  # 1: one row per launch
        n = 8 + extra
        perm = torch.randperm(n, device=DEV, generator=gen)
        bq = torch.randn(n, hq, dk, device=DEV, generator=gen).to(dtype)
        br = torch.randint(0, 8, (n,), device=DEV, generator=gen, dtype=torch.int32)
        bn = torch.randint(0, capacity + 1, (n,), device=DEV, generator=gen, dtype=torch.int32)
        bq[perm[:8]], br[perm[:8]], bn[perm[:8]] = q, rows, lens
        assert torch.equal(run(bq, br, bn, splits + more_splits)[perm[:8]], alone), (extra, more_splits)


@pytest.mark.parametrize("shape", [SHAPES["mla-v2"], SHAPES["gqa-smollm2"]], ids=["mla-v2", "gqa-smollm2"])
def test_gpu_invariant_backend_prefill_chunks_and_decode_agree(shape):
    from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.triton_invariant import TritonInvariantBackend

    hq, hkv, dk, dv = shape
    mla, n = hkv == 1, 600  # three splits
    gen = torch.Generator(device=DEV).manual_seed(hq)
    backend = TritonInvariantBackend()
    layout = KVLayout(1, (hkv, dk), None if mla else (hkv, dv), dv)
    pool = KVPool(layout, 2048, 1, torch.bfloat16, torch.device(DEV))
    slots = torch.randperm(2048, device=DEV, generator=gen)[: 2 * n].view(2, n)  # disjoint: the pool is shared
    q = torch.randn(2, n, hq, dk, device=DEV, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, n, hkv, d, device=DEV, generator=gen).to(torch.bfloat16) for d in (dk, dv))

    def attend(chunks):  # chunks: [(sequence, start, length)] run as one batch
        def tok(x):
            return torch.cat([x[s, a : a + m] for s, a, m in chunks])

        fb = ForwardBatch(torch.zeros(sum(m for *_, m in chunks), dtype=torch.long, device=DEV),
                          tok(torch.arange(n, device=DEV).expand(2, n)), tok(slots), [m for *_, m in chunks],
                          [a + m for _, a, m in chunks], [slots[s][: a + m] for s, a, m in chunks], pool, backend)
        backend.prepare(fb)
        return fb.attention(tok(q), tok(k), None if mla else tok(v), 0, dk**-0.5)

    whole = attend([(1, 0, 40), (0, 0, n)])[40:]
    parts = torch.cat([attend([(0, a, m), (1, 0, 9)])[:m] for a, m in [(0, 7), (7, 300), (307, 290)]])
    assert torch.equal(parts, whole[:597])
    for p in (0, 255, 256, 511, 512, n - 1):
        assert torch.equal(attend([(1, 39, 1), (0, p, 1)])[1], whole[p]), p
    vals = (k[0] if mla else v[0])[..., :dv].float().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q[0].float(), k[0].float().repeat_interleave(hq // hkv, 1)) * dk**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
    assert _rel_err(whole, torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)) < 1e-2


def _tiny(kind: str, tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


@pytest.mark.parametrize("kind,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("deepseek_v3", "float32")])
def test_gpu_batch_invariant_engine_with_cuda_graphs(kind, dtype, tmp_path_factory, monkeypatch):
    """The needle's prompt (250 tokens) and output cross the first split at 256. Tiny Llama's decode steps
    replay graphs; the MoE model's (the invariant expert loop reads routing back to the host) run eagerly
    until its MoE layer can be captured."""
    path = _tiny(kind, tmp_path_factory)
    rng = random.Random(3)
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, logprobs=True, ignore_eos=True)]
    seen, replays = set(), 0
    for max_bs, chunk in [(64, 2048), (64, 13), (0, 100), (0, 2048)]:  # graphs on, then off
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", str(max_bs))
        with Engine(str(path), dtype=dtype, device="cuda", batch_invariant=True, kv_cache_tokens=16384,
                    max_num_seqs=64, chunked_prefill_tokens=chunk) as engine:
            graphs = engine.executor.graphs
            assert (graphs is not None) == (max_bs > 0)
            if graphs is not None:
                run = graphs.run

                def counted(*args, **kwargs):
                    nonlocal replays
                    hidden = run(*args, **kwargs)
                    replays += hidden is not None
                    return hidden

                graphs.run = counted
            vocab = engine.model_config.vocab_size
            needle = [random.Random(99).randrange(vocab) for _ in range(250)]
            for _ in range(2):
                others = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 120))]
                          for _ in range(rng.choice([0, 5, 20]))]
                at = rng.randrange(len(others) + 1)
                for sp in params:
                    out = engine.generate(input_ids=others[:at] + [needle] + others[at:], sampling_params=sp)[at]
                    seen.add((sp.temperature, tuple(out.token_ids), tuple(out.logprobs)))
    assert len(seen) == len(params), "the needle's output changed with its batch, chunking or CUDA graphs"
    if kind == "llama":
        assert replays > 0
