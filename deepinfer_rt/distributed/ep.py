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
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

from deepinfer_rt.distributed.eplb import Placement

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

    def record(self, layer: int, ids: torch.Tensor, rank_tokens: torch.Tensor) -> None:
        """ids: this rank's (token, k) expert ids; rank_tokens (ranks,): pairs every rank receives this layer."""
        self.expert_tokens[layer] += torch.bincount(ids.flatten(), minlength=self.expert_tokens.shape[1])
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


class ExpertParallelMoE:
    """The hook a worker installs as `moe.expert_parallel` on each MoE layer (see layers/moe.py)."""

    def __init__(self, layer: int, placement: ExpertPlacement, recorder: LoadRecorder, group=None):
        self.layer = layer
        self.placement = placement
        self.recorder = recorder
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, k = ids.shape
        per_rank = self.placement.slots_per_rank
        slots = self.placement.route(self.layer, ids).flatten()  # (T * k,) global slots, token-major
        order = slots.argsort(stable=True)  # by destination rank, then slot; token order kept within a slot
        mine = torch.bincount(slots // per_rank, minlength=self.size)
        counts = mine.new_empty(self.size * self.size)
        _all_gather(counts, mine, group=self.group)
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
        y = (out.view(num_tokens, k, x.shape[1]) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if moe.shared_experts is not None and num_tokens:
            y = y + moe.shared_experts(x)
        return y

    def _all_to_all(self, rows: torch.Tensor, out_split: list[int], in_split: list[int]) -> torch.Tensor:
        out = rows.new_empty(sum(out_split), *rows.shape[1:])
        dist.all_to_all_single(out, rows, out_split, in_split, group=self.group)
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
                  device: torch.device, dtype: torch.dtype) -> None:
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
            moe.expert_parallel = ExpertParallelMoE(layer, placement, recorder)


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
    layers; no recorder on a single rank, which installs no hook)."""

    def __init__(self, initial: Placement, num_experts: int, rank: int, device: torch.device):
        self.initial = initial
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
        shard_experts(model, self.placement, self.rank, self.recorder, device, dtype)

    def init_dummy(self, model: nn.Module, seed: int) -> None:
        if self.placement is None:
            model.init_dummy(seed)
        else:
            init_dummy_sharded(model, self.placement, self.rank, seed)
