"""The fused row step of Llama models at up to 4 rows on CUDA (models/llama_gpu_step.py, kernels/row_gemv.py): the kernel against
fp32 products at SmolLM2's shapes, and the engine with the step against the module path (DEEPINFER_GPU_ROW_STEP=0)
token for token in fp32 (eager and CUDA graphs), logprobs within bf16's rounding in bf16."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_row_gemv_at_smollm2_shapes(dtype, rows):
    from deepinfer_kernels import reference
    from deepinfer_kernels.row_gemv import row_gemv

    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inter, qkv = 576, 1536, 960
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    x, r, nw = rand(rows, hidden, scale=2.0), rand(rows, hidden), 1 + rand(hidden, scale=0.1)
    w_qkv, w_gu, w_down = rand(qkv, hidden, scale=hidden**-0.5), rand(2 * inter, hidden, scale=hidden**-0.5), \
        rand(hidden, inter, scale=inter**-0.5)

    def mm(a, w):
        return (a.double() @ w.double().t()).to(dtype)

    y, s = row_gemv(x, w_qkv, residual=r, norm_weight=nw, eps=1e-5)
    assert torch.equal(s, x + r)
    h = reference.rms_norm(x + r, nw, 1e-5)
    torch.testing.assert_close(y, mm(h, w_qkv), **tol)
    y, _ = row_gemv(x, w_gu, residual=r, norm_weight=nw, eps=1e-5, silu_mul=True)
    act = reference.silu_and_mul(mm(h, w_gu))
    torch.testing.assert_close(y, act, **tol)
    torch.testing.assert_close(row_gemv(act, w_down), mm(act, w_down), **tol)
    torch.testing.assert_close(row_gemv(x, w_qkv, norm_weight=nw, eps=1e-5), mm(reference.rms_norm(x, nw, 1e-5), w_qkv),
                               **tol)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-row"), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


def _run(path, dtype: str, row_step: bool, graphs: bool, monkeypatch, pdl: bool = False):
    from deepinfer_rt.models.llama_gpu_step import GpuRowStep

    monkeypatch.setenv("DEEPINFER_GPU_ROW_STEP", "1" if row_step else "0")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "8" if graphs else "0")
    monkeypatch.setenv("DEEPINFER_GPU_PDL", "1" if pdl else "0")
    prompts = [[3 + (i * 7 + j * 13) % 200 for j in range(n)] for i, n in enumerate((5, 40, 17))]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    with Engine(str(path), dtype=dtype, device="cuda", max_num_seqs=4, kv_cache_tokens=1024) as engine:
        assert isinstance(engine.model.step_method, GpuRowStep) == row_step
        if row_step:
            assert engine.model.step_method.pdl == pdl and engine.executor.backend.pdl == pdl
        out = engine.generate(input_ids=prompts, sampling_params=params)
        if row_step:
            assert engine.model.gpu_row_layers, "the model did not qualify for the row step"
    return out


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_row_step_equals_module_path_fp32(llama_path, graphs, monkeypatch):
    fused = _run(llama_path, "float32", True, graphs, monkeypatch)
    module = _run(llama_path, "float32", False, graphs, monkeypatch)
    for a, b in zip(fused, module):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_engine_row_step_bf16_logprobs_close(llama_path, monkeypatch):
    fused = _run(llama_path, "bfloat16", True, True, monkeypatch)
    module = _run(llama_path, "bfloat16", False, True, monkeypatch)
    for a, b in zip(fused, module):
        assert a.token_ids[0] == b.token_ids[0] and abs(a.logprobs[0] - b.logprobs[0]) < 0.05
    agree = sum(x == y for a, b in zip(fused, module) for x, y in zip(a.token_ids, b.token_ids))
    assert agree >= 0.8 * sum(len(a.token_ids) for a in fused), agree


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs SM90+")
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_row_step_with_dependent_launches_is_bitwise_the_same(llama_path, graphs, monkeypatch):
    """DEEPINFER_GPU_PDL=1: the products and the decode attention start before the kernel before them ends and wait
    for it in-kernel; the arithmetic is unchanged, so tokens and logprobs are bitwise those of ordinary launches."""
    dependent = _run(llama_path, "bfloat16", True, graphs, monkeypatch, pdl=True)
    ordinary = _run(llama_path, "bfloat16", True, graphs, monkeypatch, pdl=False)
    for a, b in zip(dependent, ordinary):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
