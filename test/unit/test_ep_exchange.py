"""The capture-safe exchange of the MoE hook (distributed/ep.py `_padded`) against the exact one, on random
routings over 2-4 ranks simulated by threads in one process (the collectives are `Collectives`' two calls, done
here through shared memory): every rank's routed result is bitwise the exact exchange's, a graph's padding rows
send nothing and are not counted, and a block past its capacity makes the step's check fail."""
from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from deepinfer_rt.distributed.ep import Exchange, ExpertParallelMoE, ExpertPlacement, LoadRecorder
from deepinfer_rt.layers.moe import RoutedExperts

HIDDEN, INTER, TOP_K = 8, 6, 2


class ThreadedComm:
    """all_gather / all_to_all_single between threads: each rank posts its tensor, all read after a barrier."""

    def __init__(self, world: "World", rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        posted = self.world.post(self.rank, tensor.clone())
        out.copy_(torch.cat(posted))
        self.world.barrier.wait()

    def all_to_all(self, out, tensor, out_split=None, in_split=None) -> None:
        if in_split is None:
            in_split = [tensor.shape[0] // self.size] * self.size
        posted = self.world.post(self.rank, (tensor.clone(), list(in_split)))
        pieces = [t[sum(split[:self.rank]):sum(split[:self.rank + 1])] for t, split in posted]
        out.copy_(torch.cat(pieces))
        self.world.barrier.wait()


class World:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size

    def post(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        return list(self.slots)

    def run(self, fns):
        """fns[r]() on rank r's thread; their results, or the first exception raised."""
        results, errors = [None] * self.size, []

        def body(r):
            try:
                results[r] = fns[r]()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results


class FakeMoE(nn.Module):
    """What the hook reads of a MoE block: this rank's experts and no shared experts."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts, self.shared_experts = experts, None


class RowwiseExperts(nn.Module):
    """Experts whose padding rows are computed at slot 0 (the fused kernels' way): y = x * (slot + 1) + slot."""

    method = None

    def __init__(self, num_experts: int, first_expert_ids: list[int]):
        super().__init__()
        self.num_experts = num_experts
        self.experts = torch.tensor(first_expert_ids, dtype=torch.float32)

    def forward(self, x, weights, ids):
        e = self.experts[ids[:, 0]][:, None]
        return ((x * (e + 1) + e) * weights).to(x.dtype)


def _setup(size: int, num_experts: int, extra_slots: int, seed: int, rowwise: bool, capacity_factor: float):
    gen = torch.Generator().manual_seed(seed)
    per_rank = math.ceil(num_experts / size) + extra_slots
    # Every expert once (contiguous), the spare slots copies of other experts, at most one per rank (as EPLB).
    base = math.ceil(num_experts / size)
    placement = [list(range(r * base, min((r + 1) * base, num_experts))) for r in range(size)]
    for held in placement:
        others = [e for e in torch.randperm(num_experts, generator=gen).tolist() if e not in held]
        held += others[:per_rank - len(held)]
    full = RoutedExperts(num_experts, HIDDEN, INTER)
    with torch.no_grad():
        full.gate_up_proj.normal_(0, 0.3, generator=gen)
        full.down_proj.normal_(0, 0.3, generator=gen)
    world, hooks, moes = World(size), [], []
    for r in range(size):
        tables = ExpertPlacement([placement], num_experts, torch.device("cpu"))
        recorder = LoadRecorder(1, num_experts, size, torch.device("cpu"))
        hooks.append(ExpertParallelMoE(0, tables, recorder, Exchange(TOP_K, torch.device("cpu"), capacity_factor),
                                       ThreadedComm(world, r)))
        if rowwise:
            moes.append(FakeMoE(RowwiseExperts(per_rank, placement[r])))
        else:
            local = RoutedExperts(per_rank, HIDDEN, INTER)
            with torch.no_grad():
                local.gate_up_proj.copy_(full.gate_up_proj[placement[r]])
                local.down_proj.copy_(full.down_proj[placement[r]])
            moes.append(FakeMoE(local))
    return world, hooks, moes, full


def _inputs(num_tokens: int, num_experts: int, gen: torch.Generator, to_rank0: int = 0):
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:TOP_K] for _ in range(num_tokens)]
                      or [torch.empty(0, TOP_K, dtype=torch.long)]).view(num_tokens, TOP_K)
    if to_rank0:
        ids = torch.arange(TOP_K).repeat(num_tokens, 1) % to_rank0
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return x, weights, ids


def _exchange(world, hooks, moes, inputs, num_tokens=None, lengths=None):
    def call(r):
        hook = hooks[r]
        if num_tokens is None:
            return hook(moes[r], *inputs[r]).clone()
        with hook.exchange.padded(num_tokens, None if lengths is None else lengths[r]):
            return hook(moes[r], *inputs[r]).clone()
    return world.run([lambda r=r: call(r) for r in range(world.size)])


def _counts(hooks):
    return [(h.recorder.expert_tokens.clone(), h.recorder.rank_tokens.clone()) for h in hooks]


def _busiest_block(hooks, inputs) -> int:
    """The most pairs one rank sends one rank, from the routing tables (independent of the exchange)."""
    h = hooks[0]
    return max(int(torch.bincount(h.placement.route(0, ids).flatten() // h.placement.slots_per_rank,
                                  minlength=h.size).max()) if ids.numel() else 0 for _, _, ids in inputs)


@settings(max_examples=25, deadline=None)
@given(size=st.integers(2, 4), extra=st.integers(0, 2), seed=st.integers(0, 2**16), rowwise=st.booleans(),
       tokens=st.lists(st.integers(0, 7), min_size=4, max_size=4), factor=st.sampled_from([0.0, 0.0, 1.0, 1.5]))
def test_padded_exchange_is_bitwise_the_exact_one(size, extra, seed, rowwise, tokens, factor):
    """Every rank's routed rows bitwise the exact exchange's, or (with a capacity factor) a block past its
    capacity, which every rank's check reports: pairs are never left out silently."""
    num_experts = 6
    world, hooks, moes, full = _setup(size, num_experts, extra, seed, rowwise, factor)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = [_inputs(n, num_experts, gen) for n in tokens[:size]]
    exact = _exchange(world, hooks, moes, inputs)
    exact_counts = _counts(hooks)
    for h in hooks:
        h.recorder.reset()
    num_tokens = max(max(tokens[:size]), 1)
    padded = _exchange(world, hooks, moes, inputs, num_tokens=num_tokens)
    with hooks[0].exchange.padded(num_tokens):
        cap = hooks[0].exchange.capacity(size)
    if _busiest_block(hooks, inputs) > cap:
        for h in hooks:
            with pytest.raises(RuntimeError, match="dispatch overflow"):
                h.exchange.check(h.exchange.snapshot())
        return
    for a, b in zip(exact, padded):
        assert torch.equal(a, b)
    for (ea, ra), (eb, rb) in zip(exact_counts, _counts(hooks)):
        assert torch.equal(ea, eb) and torch.equal(ra, rb)
    if not rowwise:  # and both are the experts' own result (up to the rows each matmul saw)
        for (x, w, ids), y in zip(inputs, padded):
            if x.shape[0]:
                torch.testing.assert_close(y, full(x, w, ids), rtol=1e-5, atol=1e-6)
    for h in hooks:
        h.exchange.check(h.exchange.snapshot())  # the worst-case capacity never overflows


@settings(max_examples=10, deadline=None)
@given(size=st.integers(2, 4), seed=st.integers(0, 2**16), rowwise=st.booleans(),
       valid=st.lists(st.integers(0, 5), min_size=4, max_size=4))
def test_graph_padding_rows_send_nothing(size, seed, rowwise, valid):
    """A graph of T rows per rank, the last rows of each padding (KV length 0): the real rows' results equal the
    exact exchange over the real rows alone, and the padding rows' routing is not counted."""
    num_experts, graph_rows = 6, 6
    world, hooks, moes, _ = _setup(size, num_experts, 1, seed, rowwise, 0.0)
    gen = torch.Generator().manual_seed(seed + 2)
    inputs = [_inputs(graph_rows, num_experts, gen) for _ in range(size)]
    real = [tuple(t[:n] for t in inp) for inp, n in zip(inputs, valid)]
    exact = _exchange(world, hooks, moes, real)
    exact_counts = _counts(hooks)
    for h in hooks:
        h.recorder.reset()
    lengths = [torch.tensor([5] * n + [0] * (graph_rows - n)) for n in valid[:size]]
    padded = _exchange(world, hooks, moes, inputs, num_tokens=graph_rows, lengths=lengths)
    for a, b, n in zip(exact, padded, valid):
        assert torch.equal(a, b[:n])
        assert not b[n:].any(), "padding rows receive no expert output"
    for (ea, ra), (eb, rb) in zip(exact_counts, _counts(hooks)):
        assert torch.equal(ea, eb) and torch.equal(ra, rb)


def test_overflow_past_a_capacity_factor_fails_the_step():
    """Capacity factor 1 over 2 ranks: blocks of T x k / 2 pairs. Tokens routed evenly fit; every pair sent to
    rank 0 overflows its block, and every rank's check raises."""
    size, num_experts, n = 2, 4, 4
    world, hooks, moes, _ = _setup(size, num_experts, 0, 0, False, 1.0)
    gen = torch.Generator().manual_seed(5)
    even = []
    for _ in range(size):
        x, w, _ = _inputs(n, num_experts, gen)
        even.append((x, w, torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])))  # one pair to each rank per token
    exact = _exchange(world, hooks, moes, even)
    padded = _exchange(world, hooks, moes, even, num_tokens=n)
    assert all(torch.equal(a, b) for a, b in zip(exact, padded))
    for h in hooks:
        h.exchange.check(h.exchange.snapshot())
    skewed = [_inputs(n, num_experts, gen, to_rank0=2) for _ in range(size)]  # experts 0 and 1: rank 0's
    _exchange(world, hooks, moes, skewed, num_tokens=n)
    for h in hooks:
        with pytest.raises(RuntimeError, match="dispatch overflow.*DEEPINFER_EP_CAPACITY_FACTOR"):
            h.exchange.check(h.exchange.snapshot())


def test_a_forward_larger_than_the_agreed_size_is_refused():
    world, hooks, moes, _ = _setup(2, 4, 0, 0, False, 0.0)
    gen = torch.Generator().manual_seed(1)
    inputs = [_inputs(3, 4, gen), _inputs(1, 4, gen)]
    with pytest.raises(ValueError, match="did not agree"):
        _exchange(world, hooks, moes, inputs, num_tokens=2)
