"""Fused mixture-of-experts in Triton: (token, slot) pairs sorted by expert, then two grouped GEMMs.

    gate_up: h[pair] = silu(x[tok] @ W_gate[e]^T) * (x[tok] @ W_up[e]^T)     (one kernel, both halves;
             with swiglu_limit, DeepSeek-V4's clamp: silu(min(gate, limit)) * clamp(up, -limit, limit))
    down:    y[pair] = weight[pair] * (h[pair] @ W_down[e]^T)
    out[tok] = sum over the token's k slots of y, in slot order               (fp32 sum, one kernel)

Each program owns BLOCK_M sorted rows of one expert and BLOCK_N output columns, so an expert's weights are
read once per block of its tokens. `moe_align` (deepinfer_kernels.moe_align, one launch) builds the sorted
order on the device with no host sync (CUDA graphs capture it): each expert's pairs are padded to a multiple of
BLOCK_M; padding rows hold the sentinel pair id `num_pairs` and are masked. With only a few pairs (small decode batches) sorting costs more than it
saves: each pair then gets its own block (`per_pair`), which needs no align kernels at all.

Batch-invariant mode (`batch_invariant=True`) gives each (token, slot) pair the same result whatever else is in
the batch: one tile configuration per dtype (`invariant_tiles`: no autotuning, no choice by pair count, always
sorted), each row's K loop in the same BLOCK_K steps with no split-K; a row of a tile's tl.dot depends only on
its own inputs, so which pairs share its block does not matter. The top-k weight scales each pair's fp32 result
in the down kernel, and a token's k slots are summed in slot order (`combine_slots`), not by a torch reduction
whose vectorisation may change with the number of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait
from deepinfer_kernels.moe_align import MAX_PAIRS, moe_align

# Up to this many (token, slot) pairs each pair gets its own block instead of being sorted.
PER_PAIR_MAX = 16


@triton.jit
def pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M: tl.constexpr,
               PER_PAIR: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)
    if PER_PAIR:
        pair = tl.where(offs == 0, pid_m, num_pairs)
        expert = tl.load(BlockExpert + pid_m)  # the flat expert ids (T*k,)
        valid = True
    else:
        pair = tl.load(SortedPairs + pid_m * BLOCK_M + offs)
        expert = tl.load(BlockExpert + pid_m)
        valid = pid_m * BLOCK_M < tl.load(NumPadded)
    return pair, expert.to(tl.int64), valid


@triton.jit
def store_swiglu(H, pair, offs_n, mmask, nmask, acc_g, acc_u, limit, stride_hm):
    """h[pair, offs_n] = the clamped SwiGLU of the fp32 gate / up products (limit = +inf: the plain one, exactly),
    in H's dtype."""
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(H + pair.to(tl.int64)[:, None] * stride_hm + offs_n[None, :], h.to(H.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def store_weighted(Y, TopkWeights, pair64, offs_n, mmask, nmask, acc, stride_ym):
    """y[pair, offs_n] = the pair's top-k weight x its fp32 down product, in Y's dtype."""
    acc *= tl.load(TopkWeights + pair64, mask=mmask, other=0.0)[:, None]
    tl.store(Y + pair64[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _tuned(kernel):
    """Autotune the N/K tiles, warps and stages per (N, K, pair-count bucket, rows per block). The first call
    of a key benchmarks the configs (eagerly: CUDA-graph warm-up runs it before capture); later calls reuse
    the winner. BLOCK_M is fixed by the caller, since the expert padding of `moe_align` depends on it."""
    # The last two fit in shared memory for fp32 at BLOCK_M 128, where every other config runs out of it (the
    # autotuner scores a config that cannot launch as infinitely slow, so one that fits must be there). At a
    # V2-Lite 8K-token prefill on an H200 (bench_kernels.py --only moe_sweep, BLOCK_M 128) gate_up is fastest at
    # (128, 64, 8, 3): 0.69 of the bf16 matmul rate; down at (256, 64, 8, 3): 0.61-0.63 against 0.51. At decode
    # batches of 64 (--only decode_sweep, uniform routing, graph-timed) gate_up is fastest at (64, 128, 4, 3),
    # 178 us, and down at (128, 128, 4, 2), 95 us.
    configs = [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=st)
               for bn, bk, w, st in ((64, 128, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 256, 4, 3),
                                     (128, 64, 8, 3), (256, 64, 8, 3), (128, 128, 4, 2), (64, 64, 4, 2),
                                     (32, 32, 4, 2))]
    return triton.autotune(configs, key=["N", "K", "pairs_bucket", "BLOCK_M", "PER_PAIR"], warmup=5,
                           rep=20)(_even_k(kernel))


def _even_k(kernel):
    """EVEN_K = K is a multiple of BLOCK_K (V2-Lite: 2048 and 1408 are, for every BLOCK_K up to 128), chosen
    per launch after the tile config."""
    return triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(kernel)


# num_pairs and pairs_bucket (the autotuner's key only) are never specialised (to 1 or to multiples of 16): one
# compiled kernel per tile config for every batch. Each specialisation multiplies the configs the autotuner
# compiles, which on the H200 kept a tiny V4.1 engine compiling for minutes before its first tokens.
@triton.jit(do_not_specialize=["num_pairs", "pairs_bucket"])
def _gate_up(X, W, H, SortedPairs, BlockExpert, NumPadded, num_pairs, pairs_bucket, top_k, N, K, limit,
             stride_xm, stride_we, stride_wn, stride_hm,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PER_PAIR: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        g_ptrs = W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # (K, N) view of W_gate^T
        u_ptrs = g_ptrs + N * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # no mask along K: the loads stay vectorised
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - k0
                a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:  # fp32 weights: full fp32 products (TF32 would drift from the CPU reference)
                acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, g, acc_g)
                acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        store_swiglu(H, pair, offs_n, mmask, nmask, acc_g, acc_u, limit, stride_hm)


@triton.jit(do_not_specialize=["num_pairs", "pairs_bucket"])
def _down(H, W, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, pairs_bucket, N, K,
          stride_hm, stride_we, stride_wn, stride_ym,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PER_PAIR: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = H + pair64[:, None] * stride_hm + offs_k[None, :]
        w_ptrs = W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - k0
                a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        store_weighted(Y, TopkWeights, pair64, offs_n, mmask, nmask, acc, stride_ym)


_moe_gate_up_kernel, _moe_down_kernel = _tuned(_gate_up), _tuned(_down)


def moe_align_torch(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch form of `deepinfer_kernels.moe_align.moe_align` (about ten kernels; the reference in tests):
    ids (T, k) -> (sorted pair ids padded per expert to block_m with the sentinel T*k, expert of each
    block, number of used padded rows as a 1-element tensor). Device ops only, no host sync."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    cnt_start = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    sorted_e = flat[order]
    dest = pad_end[sorted_e] - padded[sorted_e] + torch.arange(num_pairs, device=dev) - cnt_start[sorted_e]
    max_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), pad_end[-1:]


def _align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-launch kernel at decode sizes, the torch form's parallel sort at prefill sizes (same result)."""
    align = moe_align if ids.numel() <= MAX_PAIRS else moe_align_torch
    return align(ids, num_experts, block_m)


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the pairs an expert receives (padding rows cost compute, not weight reads). At
    prefill sizes 128 (measured on an H200, V2-Lite experts, benchmark/bench_kernels.py: 2K tokens 0.36 -> 0.40
    and 8K tokens 0.47 -> 0.53 of the bf16 matmul rate against 64)."""
    if num_pairs <= PER_PAIR_MAX or num_pairs < 4 * num_experts:
        return 16
    if num_pairs < 32 * num_experts:
        return 32
    return 64 if num_pairs < 128 * num_experts else 128


@dataclass(frozen=True)
class PairBlocks:
    """The (token, slot) pairs in row blocks of one expert, as `pair_rows` reads them in every fused-MoE kernel:
    sorted by expert and each expert padded to block_m (moe_align), or with per_pair one block per pair (the flat
    ids then double as the block experts)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_blocks: int
    """The launch grid's first dimension."""
    block_m: int
    per_pair: bool

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernels' SortedPairs, BlockExpert, NumPadded arguments."""
        return self.sorted_pairs, self.block_expert, self.num_padded


def pair_blocks(ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> PairBlocks:
    """ids (T, k) -> their PairBlocks. block_m None: chosen by the pair count (_block_m), one block per pair up to
    PER_PAIR_MAX pairs; else that block_m, always sorted (batch-invariant mode's one tile configuration)."""
    num_pairs = ids.numel()
    if block_m is None:
        block_m = _block_m(num_pairs, num_experts)
        if num_pairs <= PER_PAIR_MAX:
            return PairBlocks(ids, ids.flatten(), ids, num_pairs, block_m, per_pair=True)
    sorted_pairs, block_expert, num_padded = _align(ids, num_experts, block_m)
    return PairBlocks(sorted_pairs, block_expert, num_padded, sorted_pairs.numel() // block_m, block_m,
                      per_pair=False)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, batch_invariant: bool = False, swiglu_limit: float | None = None,
              pdl: bool = False) -> torch.Tensor:
    """x (T, H); gate_up (E, 2I, H) = per expert [gate; up]; down (E, H, I); weights (T, k) fp32; ids (T, k).
    Returns sum_k weights * down(silu(gate x) * up x), (T, H) in x's dtype. batch_invariant: each token's
    result is bitwise the same for any batch (see the module docstring). swiglu_limit clamps gate and up first
    (DeepSeek-V4's experts). pdl: the expert kernels and the slot sum as programmatic dependent launches (the
    pairs' sort, where they are sorted, excepted): the same values."""
    t, k = ids.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    num_pairs = t * k
    if not (x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("fused_moe needs contiguous x and expert weights")
    if batch_invariant:  # one tile configuration for every batch, always sorted (see the module docstring)
        config = invariant_tiles(x.dtype)
        gate_up_kernel, down_kernel = _even_k(_gate_up), _even_k(_down)  # without the autotuner
        blocks, bucket = pair_blocks(ids, e, config.pop("BLOCK_M")), 0  # bucket: the autotuner's key only
    elif x.dtype == torch.float32:  # the reference dtype: batch-invariant mode's fp32 tile, never autotuned
        config = invariant_tiles(x.dtype)
        config.pop("BLOCK_M")  # pair_blocks picks its own (the largest, 128, fits shared memory with this tile)
        gate_up_kernel, down_kernel = _even_k(_gate_up), _even_k(_down)
        blocks, bucket = pair_blocks(ids, e), 0
    else:
        config = {}
        gate_up_kernel, down_kernel = _moe_gate_up_kernel, _moe_down_kernel
        blocks, bucket = pair_blocks(ids, e), triton.next_power_of_2(num_pairs)
    h = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)
    common = dict(BLOCK_M=blocks.block_m, PER_PAIR=blocks.per_pair, IEEE=x.dtype == torch.float32, **config,
                  **pdl_launch(pdl))
    gate_up_kernel[lambda meta: (blocks.num_blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        x, gate_up, h, *blocks.tensors, num_pairs, bucket, k, inter, hidden,
        float("inf") if swiglu_limit is None else float(swiglu_limit), x.stride(0), gate_up.stride(0),
        gate_up.stride(1), h.stride(0), **common)
    down_kernel[lambda meta: (blocks.num_blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](
        h, down, y, weights.flatten().float(), *blocks.tensors, num_pairs, bucket, hidden, inter, h.stride(0),
        down.stride(0), down.stride(1), y.stride(0), **common)
    return combine_slots(y, t, k, hidden, pdl)


def invariant_tiles(dtype: torch.dtype) -> dict:
    """The one tile configuration of batch-invariant mode for a dtype, whatever the batch (BLOCK_M fixes the
    expert padding of moe_align too). 16-bit: decode reads each touched expert's weights once whatever BLOCK_M,
    and BLOCK_N 64 spreads V2-Lite's six decode experts over the H200's 132 SMs (6 x 1408/64 = 132 gate_up
    programs); BLOCK_M 32 halves the padding rows' tensor-core work at decode against 64, and halves the weight
    tile re-reads from L2 at prefill (hundreds of pairs per expert) against 16. fp32 (full-precision products
    on CUDA cores) wants smaller K tiles for its registers and shared memory."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


COMBINE_BLOCK = 1024


@triton.jit
def _combine_kernel(Y, Out, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = y[t, 0] + y[t, 1] + ... + y[t, k-1]: fp32 adds in slot order, one rounding at the store."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    rows = Y + t * TOP_K * hidden + cols
    acc = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(rows + j * hidden, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * hidden + cols, acc.to(Out.dtype.element_ty), mask=mask)


def combine_slots(y: torch.Tensor, t: int, k: int, hidden: int, pdl: bool = False) -> torch.Tensor:
    """(T*k, H) weighted expert outputs -> (T, H): each token's k rows summed in slot order, in fp32 (pdl: a
    programmatic dependent launch)."""
    out = y.new_empty(t, hidden)
    if t:
        _combine_kernel[(t, triton.cdiv(hidden, COMBINE_BLOCK))](y, out, hidden, TOP_K=k, BLOCK=COMBINE_BLOCK,
                                                                  **pdl_launch(pdl))
    return out
