"""Batch-invariant fused MoE on CUDA at DeepSeek-V2-Lite shapes: a token's output is bitwise the same alone and
inside batches of 1..4096 (token, slot) pairs with uniform or skewed routing, close to an fp64 reference, and
the MoE path (routing kernel + experts) runs under CUDA-graph capture (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_kernels.fused_moe import fused_moe
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
from deepinfer_rt.layers.methods import activation_method
from deepinfer_rt.layers.moe import RoutedExperts, TritonRouting

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

INVARIANT = KernelConfig(device_type="cuda", is_batch_invariant=True)
select_experts = TritonRouting(activation_method(INVARIANT))  # the routing kernel

E, HIDDEN, INTER, K = 64, 2048, 1408, 6
PROBES = 4
_TOKENS = (1, 2, 5, 16, 33, 100, 257, 682)  # with the probes: 30 .. 4116 pairs


def _experts(dtype: torch.dtype, seed: int) -> RoutedExperts:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with build_context(INVARIANT):  # FusedExperts with the batch-invariant tiles
        experts = RoutedExperts(E, HIDDEN, INTER).to("cuda", dtype).requires_grad_(False)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5)
        experts.down_proj.copy_(torch.randn(E, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5)
    return experts


def _route(t: int, gen: torch.Generator, skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-K routing; skew > 0 sends most tokens to expert 0 (and many to expert 1)."""
    scores = torch.rand(t, E, device="cuda", generator=gen)
    scores[:, 0] += skew
    scores[:, 1] += skew / 2
    return select_experts(scores.log() * 4, K)


def _reference(experts: RoutedExperts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x[t].double()).chunk(2)
            out[t] += w[t, j].double() * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_moe_rows_invariant_and_close(dtype):
    experts = _experts(dtype, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    moe = lambda x, w, ids: fused_moe(x, experts.gate_up_proj, experts.down_proj, w, ids, batch_invariant=True)
    x = torch.randn(PROBES, HIDDEN, device="cuda", generator=gen).to(dtype)
    w, ids = _route(PROBES, gen)
    alone = torch.cat([moe(x[i : i + 1], w[i : i + 1], ids[i : i + 1]) for i in range(PROBES)])
    for t in _TOKENS:
        for skew in (0.0, 50.0):
            bx = torch.randn(t + PROBES, HIDDEN, device="cuda", generator=gen).to(dtype)
            bw, bids = _route(t + PROBES, gen, skew)
            at = int(torch.randint(t + 1, (), device="cuda", generator=gen))
            bx[at : at + PROBES], bw[at : at + PROBES], bids[at : at + PROBES] = x, w, ids
            got = moe(bx, bw, bids)[at : at + PROBES]
            assert torch.equal(got, alone), f"{(t + PROBES) * K} pairs, skew {skew}"
    assert torch.equal(experts(x, w, ids), moe(x, w, ids))  # the layer's method is this kernel
    ref = _reference(experts, x, w, ids)
    err = ((alone.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_gpu_fused_moe_skewed_batch_equals_rows_alone():
    """A 4096-pair batch in which one expert takes most tokens (many row blocks of one expert): every token's
    row equals its result alone."""
    experts = _experts(torch.bfloat16, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(683, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    w, ids = _route(683, gen, skew=50.0)
    assert (ids == 0).any(dim=1).float().mean() > 0.9
    batch = experts(x, w, ids)
    rows = torch.stack([experts(x[i : i + 1], w[i : i + 1], ids[i : i + 1])[0] for i in range(0, 683, 31)])
    assert torch.equal(batch[::31], rows)


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_gpu_invariant_moe_under_cuda_graph(tokens):
    """Routing kernel + batch-invariant experts captured in a CUDA graph (capture fails on a host sync); replay
    on new inputs equals eager, bitwise."""
    experts = _experts(torch.bfloat16, seed=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, E, device="cuda", generator=gen)
    step = lambda: experts(x, *select_experts(logits, K))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(tokens, HIDDEN, device="cuda", generator=gen))
    logits.copy_(torch.randn(tokens, E, device="cuda", generator=gen))
    graph.replay()
    expected = step()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
