"""Expert-parallel load balancing (EPLB): load statistics, redundant-expert placement, minimal rearrangement.

Vocabulary, per MoE layer:
  logical expert  e in [0, E), what the router picks;
  slot            (rank r, s in [0, S)): a physical copy of one logical expert held by rank r;
  placement       slot_experts[r][s] = the logical expert in that slot; every expert has at least one slot and
                  a rank holds at most one copy of an expert.
A token routed to an expert with c copies goes to copy (token index mod c), so an expert's tokens split evenly
across its copies and rank r's load in a step is sum over its slots of load[e] / c_e.

The policy judges a placement by the window objective: the mean over recorded steps of the per-step maximum
rank load. Balancing totals alone would put two experts that are hot in the same steps on one rank as readily
as two that alternate; the per-step objective tells them apart.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

Placement = list[list[int]]
"""slot_experts[rank][slot] -> logical expert of one layer."""


@dataclass(frozen=True)
class EPLBConfig:
    enabled: bool = False
    window_steps: int = 64
    """Steps of per-expert load kept for the policy."""
    interval_steps: int = 32
    """Steps between rearrangements."""
    redundant_per_rank: int = 2
    """Extra slots per rank for replicas of hot experts."""
    min_improvement: float = 0.02
    """A new placement is applied only when it lowers the window objective by this fraction (hysteresis:
    moving weights for a marginal gain costs more than it saves)."""


class LoadWindow:
    """Per-expert token counts of the last `window_steps` steps, every MoE layer: (steps, layers, experts)."""

    def __init__(self, window_steps: int):
        self._steps: deque[torch.Tensor] = deque(maxlen=window_steps)

    def add(self, counts: torch.Tensor) -> None:
        """counts (layers, experts) of one step, left on its device (read back only by `loads`)."""
        self._steps.append(counts.to(torch.float64))

    def __len__(self) -> int:
        return len(self._steps)

    def loads(self) -> torch.Tensor:
        """(steps, layers, experts) on the counts' device."""
        return torch.stack(list(self._steps))


def contiguous_placement(num_experts: int, num_ranks: int) -> Placement:
    """No redundancy: rank r holds experts r*E/N ... (r+1)*E/N - 1."""
    per_rank = num_experts // num_ranks
    return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(num_ranks)]


def rank_loads(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """load (steps, E) -> (steps, ranks): the tokens each rank computes per step, copies splitting evenly."""
    copies = torch.zeros(load.shape[1], dtype=load.dtype)
    for experts in placement:
        copies[experts] += 1
    share = load / copies
    return torch.stack([share[:, experts].sum(dim=1) for experts in placement], dim=1)


def window_objective(load: torch.Tensor, placement: Placement) -> float:
    """Mean over steps of the maximum rank load."""
    return rank_loads(load, placement).max(dim=1).values.mean().item()


def balance(rank_load: torch.Tensor) -> float:
    """mean / max rank load (1.0 = perfectly even), over all rows of rank_load (..., ranks)."""
    peak = rank_load.max(dim=-1).values.sum().item()
    return rank_load.mean(dim=-1).sum().item() / peak if peak else 1.0


def replica_counts(total: torch.Tensor, num_slots: int, max_copies: int) -> list[int]:
    """One copy per expert, then each spare slot to the expert with the highest load per copy (ties: lower id)."""
    counts = [1] * len(total)
    for _ in range(num_slots - len(total)):
        best = max((e for e in range(len(total)) if counts[e] < max_copies),
                   key=lambda e: (total[e].item() / counts[e], -e))
        counts[best] += 1
    return counts


def place_experts(load: torch.Tensor, num_ranks: int, slots_per_rank: int,
                  previous: Placement | None = None) -> Placement:
    """load (steps, E) over the window -> a placement with `slots_per_rank` slots on each rank.

    Copies are handed out heaviest first; each goes to the rank with a free slot and no copy of that expert
    where it raises the window objective least; ties go to a rank that already held the expert (no weights to
    move), then to the rank with the least total load. Slot order within a rank is then matched to `previous`
    so that only the slots whose expert changed need new weights.
    """
    num_experts = load.shape[1]
    if num_ranks * slots_per_rank < num_experts:
        raise ValueError(f"{num_ranks} ranks x {slots_per_rank} slots cannot hold {num_experts} experts")
    counts = replica_counts(load.sum(dim=0), num_ranks * slots_per_rank, num_ranks)
    copies = sorted(((e, load[:, e] / counts[e]) for e in range(num_experts) for _ in range(counts[e])),
                    key=lambda c: (-c[1].sum().item(), c[0]))
    held_before = [set(experts) for experts in previous] if previous else [set() for _ in range(num_ranks)]
    sets: list[list[int]] = [[] for _ in range(num_ranks)]
    per_step = torch.zeros(num_ranks, load.shape[0], dtype=load.dtype)
    for e, share in copies:
        peak = per_step.max(dim=0).values
        raise_by = (torch.maximum(per_step + share, peak) - peak).sum(dim=1).tolist()  # per rank
        totals = per_step.sum(dim=1).tolist()
        best = min((r for r in range(num_ranks) if len(sets[r]) < slots_per_rank and e not in sets[r]),
                   key=lambda r: (round(raise_by[r], 9), e not in held_before[r], totals[r], r))
        sets[best].append(e)
        per_step[best] += share
    return match_slots(sets, previous) if previous else [sorted(s) for s in sets]


def match_slots(new_sets: list[list[int]], previous: Placement) -> Placement:
    """Keep every expert a rank already holds in its old slot; fill the freed slots with the rest in order."""
    placement = []
    for experts, old in zip(new_sets, previous):
        keep = set(experts) & set(old)
        slots = [e if e in keep else None for e in old]
        incoming = iter(sorted(set(experts) - keep))
        placement.append([e if e is not None else next(incoming) for e in slots])
    return placement


@dataclass(frozen=True)
class Move:
    """Copy logical expert `expert` from (src_rank, src_slot) of the old placement into (dst_rank, dst_slot)."""
    layer: int
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def plan_moves(layer: int, old: Placement, new: Placement) -> list[Move]:
    """The slots whose expert changed, each with a source: the lowest rank holding that expert before."""
    moves = []
    for r, (old_experts, new_experts) in enumerate(zip(old, new)):
        for s, (before, after) in enumerate(zip(old_experts, new_experts)):
            if before == after:
                continue
            src = next(q for q, experts in enumerate(old) if after in experts)
            moves.append(Move(layer, after, src, old[src].index(after), r, s))
    return moves
