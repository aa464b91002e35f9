"""Long contexts on the GPU (CUDA only): decode past the old 16K-token graph row runs in CUDA graphs whose page
table rows cover the whole context, and equals the eager engine and the CPU reference token for token; an
eager decode step past the row reads its context through the device page table; long rows split over keys
equal the reference kernel."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONTEXT = 20000
"""Past the 16384-token rows graphs had before their width followed the pool."""


@pytest.fixture(scope="module", params=("llama", "deepseek_v2"))
def long_path(request, tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"), max_position_embeddings=32768)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (CONTEXT, CONTEXT + 777, 300)]


PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(path, device: str, page_size: int = 1) -> Engine:
    return Engine(str(path), dtype="float32", device=device, kv_cache_tokens=3 * (CONTEXT + 1024),
                  max_num_seqs=4, page_size=page_size, chunked_prefill_tokens=8192, enable_prefix_cache=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graphs_decode_past_the_old_row_and_equal_eager(long_path, page_size, monkeypatch):
    with _engine(long_path, "cuda", page_size) as gpu:
        graphs = gpu.executor.graphs
        assert graphs is not None and graphs.pages.width * page_size >= CONTEXT + 777 + 8
        prompts = _prompts(gpu.model_config.vocab_size)
        checked = []
        inner = graphs.run

        def run(batch, *args):
            hidden = inner(batch, *args)
            if hidden is not None:
                torch.cuda.synchronize()
                graphs.check_covers([it.req for it in batch.items], [it.start + 1 for it in batch.items])
                checked.append(max(it.start for it in batch.items))
            return hidden

        monkeypatch.setattr(graphs, "run", run)
        graphed = gpu.generate(input_ids=prompts, sampling_params=PARAMS)
    assert checked and max(checked) >= CONTEXT + 777, "no graph step past the old row"
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "0")
    with _engine(long_path, "cuda", page_size) as eager:
        assert eager.executor.graphs is None
        want = eager.generate(input_ids=prompts, sampling_params=PARAMS)
        assert eager.executor.stats()["num_uploaded_pages"] > 0  # eager steps read the device page table
    assert [o.token_ids for o in graphed] == [o.token_ids for o in want]


def test_long_context_gpu_equals_cpu_reference(long_path):
    with _engine(long_path, "cpu") as cpu:
        prompts = _prompts(cpu.model_config.vocab_size)[:1]
        ref = cpu.generate(input_ids=prompts, sampling_params=PARAMS)
    with _engine(long_path, "cuda") as gpu:
        out = gpu.generate(input_ids=prompts, sampling_params=PARAMS)
    assert out[0].token_ids == ref[0].token_ids


@pytest.mark.parametrize("dk,dv,hkv,hq", [(576, 512, 1, 16), (64, 64, 3, 9)])
def test_split_decode_at_long_rows_equals_reference(dk, dv, hkv, hq):
    from deepinfer_kernels.decode_attention import (num_splits_for, paged_decode_attention,
                                                    paged_decode_attention_ref)

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [40000, 3, 2048, 0]
    ps = 1
    width = max(lens)
    k = torch.randn(width * len(lens), hkv, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    v = k[..., :dv] if hkv == 1 else torch.randn(width * len(lens), hkv, dv, device="cuda", dtype=torch.bfloat16,
                                                 generator=g)
    table = torch.randperm(width * len(lens), device="cuda", generator=g).view(len(lens), width).to(torch.int32)
    rows = torch.arange(len(lens), device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q = torch.randn(len(lens), hq, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = paged_decode_attention_ref(q, k, v, table, rows, seq_lens, ps, dk**-0.5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits in (1, num_splits_for(1, hkv, sms, dk), 128):
        out = paged_decode_attention(q, k, v, table, rows, seq_lens, ps, dk**-0.5, splits)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_gqa_decode_over_a_large_pool_equals_reference():
    """64 rows of 32K tokens each (a 2M-slot pool, SmolLM2's heads) at the engine's split count and at one split:
    the first and last rows against the torch reference."""
    from deepinfer_kernels.decode_attention import num_splits_for, paged_decode_attention, paged_decode_attention_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    batch, context, hkv, hq, d = 64, 32768, 3, 9, 64
    k = torch.randn(batch * context, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch * context, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.arange(batch * context, device="cuda", dtype=torch.int32).view(batch, context)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ends = torch.tensor([0, batch - 1], device="cuda")
    ref = paged_decode_attention_ref(q[ends], k, v, table, rows[ends], lens[ends], 1, d**-0.5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits in (1, num_splits_for(batch, hkv, sms, d)):
        out = paged_decode_attention(q, k, v, table, rows, lens, 1, d**-0.5, splits)
        torch.cuda.synchronize()
        torch.testing.assert_close(out[ends].float(), ref.float(), rtol=2e-2, atol=2e-2)
