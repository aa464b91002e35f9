"""MoE alignment in one Triton launch: (token, slot) pairs grouped by expert, each expert padded to BLOCK_M.

The torch form (`fused_moe.moe_align_torch`) is about ten kernels (histogram, two scans, a radix sort, gathers,
scatters, a search); at decode sizes they cost more than the expert GEMMs they feed save. Here one program per
expert does all of its part:

    counts   every program histograms all experts' pairs (the ids are a few KB at decode, read from L2), so
             each knows its own padded start without a second launch or a global barrier;
    scatter  its pairs, in pair order (the stable order of the torch form), to its rows of the sorted list;
    pad      its padding rows (the sentinel pair id `num_pairs`) and the expert id of each of its blocks.

Rows past the last expert's padded end are left unwritten: the expert kernels skip blocks at or past
`num_padded`, as they do for the torch form.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_align_kernel(Ids, SortedPairs, BlockExpert, NumPadded, num_pairs, num_experts,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        # Lanes past the end count as expert 0 and are taken off again below (no masked histogram needed).
        counts += tl.histogram(tl.load(Ids + offs, mask=offs < num_pairs, other=0).to(tl.int32), BLOCK_E)
    over = tl.cdiv(num_pairs, BLOCK_P) * BLOCK_P - num_pairs
    counts -= tl.where(experts == 0, over, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0), 0)
    count = tl.sum(tl.where(experts == e, counts, 0), 0)
    end = start + tl.sum(tl.where(experts == e, padded, 0), 0)
    rank = start
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        mine = (tl.load(Ids + offs, mask=offs < num_pairs, other=-1) == e).to(tl.int32)
        dest = rank + tl.cumsum(mine, 0) - mine
        tl.store(SortedPairs + dest, offs.to(tl.int32), mask=mine == 1)
        rank += tl.sum(mine, 0)
    rows = start + count + tl.arange(0, BLOCK_M)
    tl.store(SortedPairs + rows, num_pairs, mask=rows < end)  # at most BLOCK_M - 1 padding rows
    for b in range(start // BLOCK_M, end // BLOCK_M):
        tl.store(BlockExpert + b, e)
    if e == num_experts - 1:
        tl.store(NumPadded, end)


MAX_PAIRS = 4096
"""Above this many pairs (prefill) every program's serial passes over all ids cost more than the torch form's
parallel sort; `fused_moe` then uses the torch form."""


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (T, k) -> (sorted pair ids padded per expert to block_m with the sentinel T*k, expert of each
    block, number of used padded rows as a 1-element tensor). One launch, no host sync."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    max_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=flat.device)  # past the end: unread
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_p = max(16, min(1024, triton.next_power_of_2(num_pairs)))
    _moe_align_kernel[(num_experts,)](flat, sorted_pairs, block_expert, num_padded, num_pairs, num_experts,
                                      BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=triton.next_power_of_2(num_experts),
                                      num_warps=8 if block_p >= 512 else 4)
    return sorted_pairs, block_expert, num_padded
