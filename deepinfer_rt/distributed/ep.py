"""Expert parallelism inside a worker: expert placement tables, the MoE dispatch/combine hook, expert sharding.

Attention is data-parallel: each EP rank runs attention over its own requests only, so each rank enters a MoE
layer with its own tokens (none at all in an empty step: the layer's collectives still run, see `run_empty`).
For its tokens each rank then does

    route      each (token, k) pair -> a slot (rank, local slot) holding a copy of the chosen expert
    counts     all-gather of the (source, destination) pair counts: every rank learns the all-to-all splits
    dispatch   all-to-all: the pairs' hidden rows and slot ids go to the slots' ranks
    compute    the local experts over the rows they received (the model's own grouped reference)
    combine    all-to-all back; the k results of a token are weighted and summed in top-k order

A receiving rank orders an expert's rows by source rank, then by token within the source, and the k results of
a token are summed in the same order whatever rank computed them, so the routed result of a token does not
depend on the EP size; with the fixed-tile (batch-invariant) expert GEMMs it is bit-identical across EP sizes.

Two exchanges do this. The exact one (eager steps) reads the gathered counts back to the host and sizes each
all-to-all by them. The capture-safe one (decode steps replayed from CUDA graphs, `Exchange.padded`) reads
nothing back: every rank sends every destination a block of `capacity` rows (equal splits), its pairs first
and padding after; padding rows carry the experts' padding slot (`padding_slot`: skipped by the torch experts,
computed and never read by the fused kernels), and the combine reads back only the positions its pairs were
sent to. Both keep the same rows per expert in the same order and the same top-k sum, so a token's routed
result is bitwise the same from either. Capacity is the worst case (all T x k pairs of a rank to one rank, T
the step's agreed tokens per rank) unless DEEPINFER_EP_CAPACITY_FACTOR sets a smaller one; pairs past it are
not sent, and the step fails (`Exchange.check`) instead of answering.
"""
from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from deepinfer_rt.distributed.eplb import Placement
from deepinfer_rt.layers.moe import ExpertsMethod

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12


class ExpertPlacement:
    """The placement of every MoE layer and its routing tables on the device.

    copies[l, e, j] = global slot (rank * S + local slot) of the j-th copy of expert e (padded by repetition),
    num_copies[l, e] = its number of copies.
    """

    def __init__(self, layers: list[Placement], num_experts: int, device: torch.device):
        self.layers = layers
        self.num_experts = num_experts
        self.num_ranks = len(layers[0])
        self.slots_per_rank = len(layers[0][0])
        self.copies = torch.zeros(len(layers), num_experts, self.num_ranks, dtype=torch.long, device=device)
        self.num_copies = torch.zeros(len(layers), num_experts, dtype=torch.long, device=device)
        for i, placement in enumerate(layers):
            self.set_layer(i, placement)

    def set_layer(self, layer: int, placement: Placement) -> None:
        slots: list[list[int]] = [[] for _ in range(self.num_experts)]
        for r, experts in enumerate(placement):
            for s, e in enumerate(experts):
                slots[e].append(r * self.slots_per_rank + s)
        if any(not s for s in slots):
            raise ValueError(f"layer {layer}: placement leaves experts without a copy")
        table = [s + [s[0]] * (self.num_ranks - len(s)) for s in slots]
        self.layers[layer] = placement
        self.copies[layer] = torch.tensor(table, device=self.copies.device)
        self.num_copies[layer] = torch.tensor([len(s) for s in slots], device=self.copies.device)

    def route(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids (T, k) logical experts -> (T, k) global slots; token i takes copy i mod (number of copies)."""
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        return self.copies[layer][ids, token % self.num_copies[layer][ids]]


class LoadRecorder:
    """Routing counts, kept on the device (no host sync in a step): tokens per logical expert of the step in
    progress (EPLB's input, taken each step as a device tensor), and over all steps the (token, expert) pairs
    per rank and the sum over steps and layers of the busiest rank's pairs (the balance in engine stats, read
    only when asked)."""

    def __init__(self, num_layers: int, num_experts: int, num_ranks: int, device: torch.device):
        self.expert_tokens = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device)
        self.rank_tokens = torch.zeros(num_layers, num_ranks, dtype=torch.long, device=device)
        self.total_rank_tokens = torch.zeros(num_ranks, dtype=torch.long, device=device)
        self.sum_max = torch.zeros((), dtype=torch.long, device=device)

    def record(self, layer: int, ids: torch.Tensor, rank_tokens: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """ids: this rank's (token, k) expert ids; rank_tokens (ranks,): pairs every rank receives this layer;
        valid (tokens,) bool: the tokens to count (a graph's padding rows are not), by default all. A scatter,
        not a bincount, which would read its size back to the host."""
        flat = ids.flatten().long()
        ones = torch.ones_like(flat) if valid is None else valid[:, None].expand(ids.shape).flatten().long()
        self.expert_tokens[layer].scatter_add_(0, flat, ones)
        self.rank_tokens[layer] += rank_tokens

    def take(self) -> torch.Tensor:
        """End of a step: fold its rank counts into the totals; returns its expert counts (layers, experts)."""
        self.total_rank_tokens += self.rank_tokens.sum(0)
        self.sum_max += self.rank_tokens.max(1).values.sum()
        self.rank_tokens.zero_()
        counts = self.expert_tokens.clone()
        self.expert_tokens.zero_()
        return counts

    def totals(self) -> tuple[list[int], int]:
        return self.total_rank_tokens.tolist(), int(self.sum_max)

    def reset(self) -> None:
        """Forget every count (those of the CUDA graphs' warm-up forwards)."""
        for counts in (self.expert_tokens, self.rank_tokens, self.total_rank_tokens, self.sum_max):
            counts.zero_()


class Exchange:
    """Which exchange the MoE hooks of a worker run in the forward being launched, set by the worker around it
    (every rank alike, `padded`), and the capture-safe exchange's overflow flag. Shared by every hook of the
    worker (the target's and MTP's layers)."""

    def __init__(self, top_k: int, device: torch.device, capacity_factor: float = 0.0):
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        """DEEPINFER_EP_CAPACITY_FACTOR: 0 = the worst case, else blocks of factor x the even share (see
        `capacity`)."""
        self.num_tokens: int | None = None
        """None: the exact exchange. T: the capture-safe one, blocks sized for at most T tokens on every rank."""
        self.row_lengths: torch.Tensor | None = None
        """While a graph is captured: its static KV lengths (T,), 0 on padding rows, whose pairs are not sent."""
        self.overflow = torch.zeros((), dtype=torch.long, device=device)
        """The most pairs any block had to leave out, over every capture-safe exchange so far (sticky)."""

    def capacity(self, num_ranks: int) -> int:
        """Rows of one (source, destination) block: T x k (every pair of a rank to one rank), or with a capacity
        factor f, ceil(f x T x k / ranks) -- f times a destination's even share -- capped at T x k."""
        worst = self.num_tokens * self.top_k
        if self.capacity_factor <= 0:
            return worst
        return max(1, min(worst, math.ceil(self.capacity_factor * worst / num_ranks)))

    @contextmanager
    def padded(self, num_tokens: int, row_lengths: torch.Tensor | None = None) -> Iterator[None]:
        """The forwards inside run the capture-safe exchange for `num_tokens` tokens per rank (graph capture:
        with the graph's row lengths). Also CudaGraphRunner's capture scope."""
        if num_tokens < 1:
            raise ValueError(f"a capture-safe exchange needs at least one token per rank, got {num_tokens}")
        self.num_tokens, self.row_lengths = num_tokens, row_lengths
        try:
            yield
        finally:
            self.num_tokens, self.row_lengths = None, None

    def snapshot(self):
        """After a step's forwards are launched: the overflow flag on its way to the host (no wait)."""
        if not self.overflow.is_cuda:
            return self.overflow.clone()
        host = torch.empty((), dtype=torch.long, pin_memory=True)
        host.copy_(self.overflow, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def check(self, snapshot) -> None:
        """Raise if a block overflowed by the time of `snapshot`: that step's results are incomplete."""
        if isinstance(snapshot, tuple):
            host, ready = snapshot
            ready.synchronize()
            snapshot = host
        excess = int(snapshot)
        if excess > 0:
            raise RuntimeError(
                f"expert-parallel dispatch overflow: a (source, destination) block of the capture-safe exchange "
                f"had {excess} (token, expert) pairs more than its capacity, which were not computed; raise "
                f"DEEPINFER_EP_CAPACITY_FACTOR (0 = the worst case, which never overflows)")


class Collectives:
    """The two collectives of a MoE hook, over a torch.distributed group (tests substitute their own)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        _all_gather(out, tensor, group=self.group)

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_split: list[int] | None = None,
                   in_split: list[int] | None = None) -> None:
        """Splits None: equal blocks (the capture-safe exchange)."""
        dist.all_to_all_single(out, tensor, out_split, in_split, group=self.group)


def padding_slot(experts: nn.Module) -> int:
    """The local slot a padding row of the capture-safe exchange names: one the experts' method skips
    (ExpertsMethod.padding_slot), else slot 0 (computed, never read)."""
    method = getattr(experts, "method", None)
    return method.padding_slot(experts.num_experts) if isinstance(method, ExpertsMethod) else 0


class ExpertParallelMoE:
    """The hook a worker installs as `moe.expert_parallel` on each MoE layer (see layers/moe.py)."""

    def __init__(self, layer: int, placement: ExpertPlacement, recorder: LoadRecorder, exchange: Exchange,
                 comm: Collectives | None = None):
        self.layer = layer
        self.placement = placement
        self.recorder = recorder
        self.exchange = exchange
        self.comm = comm or Collectives()
        self.rank = self.comm.rank
        self.size = self.comm.size

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, k = ids.shape
        if self.exchange.num_tokens is None:
            out = self._exact(moe, x, ids)
        else:
            out = self._padded(moe, x, ids)
        y = (out.view(num_tokens, k, x.shape[1]) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if moe.shared_experts is not None and num_tokens:
            y = y + moe.shared_experts(x)
        return y

    def _exact(self, moe: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(T * k, H) routed rows in (token, k) order, through all-to-alls sized on the host."""
        k = ids.shape[1]
        per_rank = self.placement.slots_per_rank
        slots = self.placement.route(self.layer, ids).flatten()  # (T * k,) global slots, token-major
        order = slots.argsort(stable=True)  # by destination rank, then slot; token order kept within a slot
        mine = torch.bincount(slots // per_rank, minlength=self.size)
        counts = mine.new_empty(self.size * self.size)
        self.comm.all_gather(counts, mine)
        counts = counts.view(self.size, self.size)  # [source][destination] (token, k) pairs
        self.recorder.record(self.layer, ids, counts.sum(0))
        counts = counts.tolist()
        send_split, recv_split = counts[self.rank], [row[self.rank] for row in counts]
        recv_x = self._all_to_all(x[order // k], recv_split, send_split)
        recv_slot = self._all_to_all(slots[order] % per_rank, recv_split, send_split)
        if recv_x.shape[0]:
            # Rows arrive by source rank, each source's sorted by slot: per expert, the global token order.
            # Weight 1 (exact): the routing weights are applied after combine, as without EP.
            ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=x.device)
            recv_y = moe.experts(recv_x, ones, recv_slot[:, None])
        else:
            recv_y = recv_x
        back = self._all_to_all(recv_y, send_split, recv_split)
        out = torch.empty_like(back)
        out[order] = back  # (token, k) order
        return out

    def _padded(self, moe: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The capture-safe form of `_exact`: fixed shapes, no value read back to the host.

            send[d * cap + j] = the j-th pair (slot order) this rank sends rank d, j < cap; rows past a
                                rank's pairs hold zeros and the padding slot; pairs not sent go to a trash row
            recv[s * cap + j] = the j-th pair from rank s: per expert the exact exchange's rows, in its order
        """
        ex = self.exchange
        num_tokens, k = ids.shape
        if num_tokens > ex.num_tokens:
            raise ValueError(f"a forward of {num_tokens} tokens in a capture-safe exchange sized for "
                             f"{ex.num_tokens} per rank (the ranks did not agree the step's size)")
        size, per_rank, hidden = self.size, self.placement.slots_per_rank, x.shape[1]
        cap = ex.capacity(size)
        trash = size * cap
        dev = x.device
        slots = self.placement.route(self.layer, ids).flatten()
        dest = slots // per_rank
        valid = None
        if ex.row_lengths is not None:  # a graph's padding rows send nothing
            valid = ex.row_lengths[:num_tokens] > 0
            pair_valid = valid[:, None].expand(num_tokens, k).flatten()
            dest = torch.where(pair_valid, dest, size)
            slots = torch.where(pair_valid, slots, size * per_rank)
        order = slots.argsort(stable=True)  # as in _exact; pairs not sent last
        mine = torch.zeros(size + 1, dtype=torch.long, device=dev).scatter_add_(0, dest, torch.ones_like(dest))
        mine = mine[:size].contiguous()
        counts = mine.new_empty(size * size)
        self.comm.all_gather(counts, mine)
        counts = counts.view(size, size)
        self.recorder.record(self.layer, ids, counts.sum(0), valid)
        torch.maximum(ex.overflow, (counts.max() - cap).clamp(min=0), out=ex.overflow)
        sorted_dest = dest[order]
        first = torch.cat([mine.cumsum(0) - mine, mine.new_zeros(1)])  # each destination's first sorted pair
        within = torch.arange(slots.numel(), device=dev) - first[sorted_dest]
        pos = torch.where((sorted_dest < size) & (within < cap), sorted_dest * cap + within, trash)
        send_x = x.new_zeros(trash + 1, hidden)
        send_x[pos] = x[order // k]
        send_slot = torch.full((trash + 1,), padding_slot(moe.experts), dtype=torch.long, device=dev)
        send_slot[pos] = slots[order] % per_rank
        recv_x = self._all_to_all(send_x[:trash])
        recv_slot = self._all_to_all(send_slot[:trash])
        ones = torch.ones(trash, 1, dtype=torch.float32, device=dev)
        back = self._all_to_all(moe.experts(recv_x, ones, recv_slot[:, None]))
        back = torch.cat([back, back.new_zeros(1, hidden)])  # pairs not sent read the trash row: zeros
        out = torch.empty(slots.numel(), hidden, dtype=back.dtype, device=dev)
        out[order] = back[pos]
        return out

    def _all_to_all(self, rows: torch.Tensor, out_split: list[int] | None = None,
                    in_split: list[int] | None = None) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0] if out_split is None else sum(out_split), *rows.shape[1:])
        self.comm.all_to_all(out, rows, out_split, in_split)
        return out


@torch.no_grad()
def run_empty(model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """An empty step: a rank with no requests this step takes its part in every MoE layer's collectives, in
    layer order, with no tokens of its own (it still computes the rows other ranks send its experts)."""
    x = torch.empty(0, hidden_size, dtype=dtype, device=device)
    weights, ids = torch.empty(0, 1, device=device), torch.empty(0, 1, dtype=torch.long, device=device)
    for moe in moe_layers(model):
        moe.expert_parallel(moe, x, weights, ids)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks: modules with an `expert_parallel` hook slot, routed `experts` holding fused (E, ...)
    tensors gate_up_proj and down_proj (layers/moe.py RoutedExperts, models/deepseek_v4/moe.py ClampedExperts), and
    `shared_experts` (or None)."""
    return [m for m in model.modules() if hasattr(m, "expert_parallel") and hasattr(m, "experts")]


_EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
"""The routed experts' fused (E, ...) tensors: the weights and, for FP8 / MXFP4 checkpoints, their scales."""
_DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expert_tensors(experts: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of each fused per-expert tensor the routed experts hold (a scale dequantized away at
    load is None, and absent here)."""
    return [(name, getattr(experts, name)) for name in _EXPERT_TENSORS if getattr(experts, name, None) is not None]


def shard_experts(model: nn.Module, placement: ExpertPlacement, rank: int, recorder: LoadRecorder,
                  device: torch.device, dtype: torch.dtype, exchange: Exchange) -> None:
    """Replace each MoE layer's full-size expert tensors by this rank's slots (uninitialised, on `device`; 16/32-
    bit weights in `dtype`, quantized storage -- FP8 values, packed MXFP4, scales -- in its own). Checkpoint
    tensors hold every expert (fused, (E, ...)); the weight loader keeps the rows of the experts in this rank's
    slots and hands them to the tensor's own loader (an FP8 / MXFP4 format check, an unpacking) when it has
    one."""
    for layer, moe in enumerate(moe_layers(model)):
        local = placement.layers[layer][rank]
        experts = moe.experts  # kept (its other settings too, e.g. the SwiGLU clamp); only its tensors shrink
        for name, full in expert_tensors(experts):
            kept = dtype if full.dtype in _DENSE_DTYPES and not name.endswith("_scale_inv") else full.dtype
            param = nn.Parameter(torch.empty(len(local), *full.shape[1:], device=device, dtype=kept),
                                 requires_grad=False)
            param.__dict__.update({k: v for k, v in full.__dict__.items() if k != "weight_loader"})
            param.weight_loader = _expert_rows_loader(local, getattr(full, "weight_loader", None))
            setattr(experts, name, param)
        experts.num_experts = len(local)
        if placement.num_ranks > 1:  # one rank: the layer's own forward, with nothing to exchange
            moe.expert_parallel = ExpertParallelMoE(layer, placement, recorder, exchange)


def _expert_rows_loader(local: list[int], inner=None):
    def load(param: nn.Parameter, tensor: torch.Tensor) -> None:
        if inner is None:
            param.data.copy_(tensor[local])
        else:
            inner(param, tensor[local])
    return load


def _seed(seed: int, *parts) -> int:
    return seed * 1_000_003 + zlib.crc32(repr(parts).encode())


@torch.no_grad()
def init_dummy_sharded(model: nn.Module, placement: ExpertPlacement, rank: int, seed: int) -> None:
    """load_format='dummy' for EP workers: normal(0, 0.02) (norms 1) drawn on the device, each expert from a
    seed of its own, so the same logical expert gets the same weights whatever rank and slot hold it and the
    model is the same for every EP size."""
    gen = torch.Generator(device=next(model.parameters()).device)
    expert_params = {}
    for layer, moe in enumerate(moe_layers(model)):
        for _, p in expert_tensors(moe.experts):
            expert_params[id(p)] = (layer, placement.layers[layer][rank])
    params = dict(model.named_parameters())
    for name, p in params.items():
        scaled = name + "_scale_inv" in params  # FP8 values / packed MXFP4 codes (a quantized checkpoint's config)
        if "norm" in name and p.dim() == 1:
            p.fill_(1.0)
        elif name.endswith("_scale_inv"):  # CausalLM.init_dummy's scales: e8m0 bytes 2^-6, float ones 0.02
            p.fill_(127 - 6 if p.dtype == torch.uint8 else 0.02)
        elif id(p) in expert_params:
            layer, local = expert_params[id(p)]
            kind = name.rsplit(".", 1)[-1]
            for s, e in enumerate(local):
                _draw(p[s], gen.manual_seed(_seed(seed, layer, kind, e)), scaled)
        elif p.is_floating_point():
            _draw(p, gen.manual_seed(_seed(seed, name)), scaled)
        # else: tables (e.g. V4's token -> expert hash), drawn below by the model's own rule
    init_tables = getattr(model, "init_dummy_tables", None)
    if init_tables is not None:
        init_tables(seed)


def _draw(p: torch.Tensor, gen: torch.Generator, scaled: bool) -> None:
    """normal(0, 0.02); a block-scaled weight's values normal(0, 1) (its scales are 0.02), packed e2m1 pairs any
    byte, as CausalLM.init_dummy draws them."""
    if p.dtype == torch.int8:
        p.copy_(torch.randint(-128, 128, p.shape, generator=gen, dtype=torch.int8, device=p.device))
    elif scaled or p.dtype not in _DENSE_DTYPES:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device=p.device))
    else:
        p.normal_(0.0, 0.02, generator=gen)


class ExpertShard:
    """build_model's shard hook for one EP rank: every MoE layer starts from the same placement of the routed
    experts; the rank keeps its slots of each (shard_experts) and installs the dispatch/combine hook. After the
    build, `placement` and `recorder` are the tables and counters the worker keeps (None for a model without MoE
    layers; no recorder on a single rank, which installs no hook). The hooks share `exchange`."""

    def __init__(self, initial: Placement, num_experts: int, rank: int, device: torch.device, exchange: Exchange):
        self.initial = initial
        self.exchange = exchange
        self.num_experts = num_experts
        self.rank = rank
        self.device = device
        self.placement: ExpertPlacement | None = None
        self.recorder: LoadRecorder | None = None

    def __call__(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        num_moe = len(moe_layers(model))
        if not num_moe:
            return
        self.placement = ExpertPlacement([[list(experts) for experts in self.initial] for _ in range(num_moe)],
                                         self.num_experts, self.device)
        if len(self.initial) > 1:
            self.recorder = LoadRecorder(num_moe, self.num_experts, len(self.initial), self.device)
        shard_experts(model, self.placement, self.rank, self.recorder, device, dtype, self.exchange)

    def init_dummy(self, model: nn.Module, seed: int) -> None:
        if self.placement is None:
            model.init_dummy(seed)
        else:
            init_dummy_sharded(model, self.placement, self.rank, seed)
