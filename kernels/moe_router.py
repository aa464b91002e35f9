"""MoE routing in one Triton kernel: a token's router logits -> its top-k experts (ascending ids) and weights.

The torch form (deepinfer_rt.layers.moe.select_experts) takes about seven small kernels per layer (cast,
softmax, top-k, group masks, sort, gather, scale), which at small decode batches cost more than the expert
GEMMs' weight reads. Here one program per token holds its E scores as a (groups, experts per group) tile:
softmax, sigmoid or sqrt(softplus) (DeepSeek-V4), optional correction bias, group selection (V2's best expert per group, V3's best two), then
k rounds of "take the best remaining" and k rounds of "take the lowest chosen id". Ties go to the lower expert id.
With `n_shared`, each token's row continues with the shared experts appended after the routed ones (ids E..E+S-1,
weight 1), so one fused-MoE launch runs routed and shared experts together (deepinfer_rt.layers.moe).
`route_hashed` takes the experts from a per-token table instead (DeepSeek-V4's hash-routed layers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

GREEDY, GROUP_LIMITED_GREEDY, NOAUX_TC = 0, 1, 2
METHODS = {"greedy": GREEDY, "group_limited_greedy": GROUP_LIMITED_GREEDY, "noaux_tc": NOAUX_TC}
SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _route_kernel(Logits, Bias, Weights, Ids, TokenIds, Table, stride_l, stride_table, scaling,
                  G: tl.constexpr, EG: tl.constexpr, BG: tl.constexpr, BEG: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, KEEP_GROUPS: tl.constexpr, SCORING: tl.constexpr, METHOD: tl.constexpr,
                  NORM: tl.constexpr, SHARED: tl.constexpr, SP: tl.constexpr, HASH: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BG)
    j = tl.arange(0, BEG)[None, :]
    valid = (offs_g[:, None] < G) & (j < EG)
    idx = offs_g[:, None] * EG + j  # the expert id of each tile entry
    none = G * EG  # larger than every id
    logit = tl.load(Logits + t * stride_l + idx, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORING == 1:  # sigmoid
        scores = 1.0 / (1.0 + tl.exp(-logit))
    elif SCORING == 2:  # sqrt(softplus), softplus as torch's (linear past 20)
        u = tl.exp(tl.minimum(logit, 20.0))
        one_u = 1.0 + u
        # log1p(u) to fp32 accuracy for small u: log(1 + u) scaled by u over the increment 1 + u really holds
        log1p = tl.where(one_u == 1.0, u, tl.log(one_u) * (u / (one_u - 1.0)))
        scores = tl.sqrt(tl.where(logit > 20.0, logit, log1p))
    else:
        p = tl.exp(logit - tl.max(tl.max(logit, 1), 0))
        scores = p / tl.sum(tl.sum(p, 1), 0)
    if HASH:  # the token's experts from its row of the table, in the table's order
        offs_k = tl.arange(0, KP)
        token = tl.load(TokenIds + t).to(tl.int64)
        ids = tl.load(Table + token * stride_table + offs_k, mask=offs_k < K, other=0).to(tl.int64)
        w = tl.zeros([KP], tl.float32)
        for i in tl.static_range(K):
            pick = tl.sum(tl.where(offs_k == i, ids, 0), 0)
            w = tl.where(offs_k == i, tl.sum(tl.sum(tl.where(idx == pick, scores, 0.0), 1), 0), w)
        if NORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        tl.store(Ids + t * K + offs_k, ids, mask=offs_k < K)
        tl.store(Weights + t * K + offs_k, w * scaling, mask=offs_k < K)
    else:
        choice = tl.where(valid, scores, float("-inf"))
        if METHOD == 2:
            choice += tl.load(Bias + idx, mask=valid, other=0.0).to(tl.float32)
        if METHOD != 0:
            best = tl.max(choice, 1)
            if METHOD == 1:
                group_score = best
            else:  # best two of each group: remove one copy of the best, take the best again
                first = tl.min(tl.where(choice == best[:, None], j, BEG), 1)
                group_score = best + tl.max(tl.where(j == first[:, None], float("-inf"), choice), 1)
            group_score = tl.where(offs_g < G, group_score, float("-inf"))
            kept = offs_g < 0
            for _ in tl.static_range(KEEP_GROUPS):
                top = tl.max(group_score, 0)
                g = tl.min(tl.where(group_score == top, offs_g, BG), 0)
                kept = kept | (offs_g == g)
                group_score = tl.where(offs_g == g, float("-inf"), group_score)
            choice = tl.where(kept[:, None], choice, float("-inf"))
        chosen = idx < 0
        for _ in tl.static_range(K):
            top = tl.max(tl.max(choice, 1), 0)
            pick = tl.min(tl.min(tl.where((choice == top) & valid, idx, none), 1), 0)
            chosen = chosen | (idx == pick)
            choice = tl.where(idx == pick, float("-inf"), choice)
        offs_k = tl.arange(0, KP)
        ids = tl.zeros([KP], tl.int64)
        w = tl.zeros([KP], tl.float32)
        for i in tl.static_range(K):  # chosen ids in ascending order, with their unbiased scores
            low = tl.min(tl.min(tl.where(chosen, idx, none), 1), 0)
            ids = tl.where(offs_k == i, low, ids)
            w = tl.where(offs_k == i, tl.sum(tl.sum(tl.where(idx == low, scores, 0.0), 1), 0), w)
            chosen = chosen & (idx != low)
        if NORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        width = K + SHARED
        tl.store(Ids + t * width + offs_k, ids, mask=offs_k < K)
        tl.store(Weights + t * width + offs_k, w * scaling, mask=offs_k < K)
        if SHARED > 0:
            offs_s = tl.arange(0, SP)
            smask = offs_s < SHARED
            tl.store(Ids + t * width + K + offs_s, (none + offs_s).to(tl.int64), mask=smask)
            tl.store(Weights + t * width + K + offs_s, tl.full([SP], 1.0, tl.float32), mask=smask)


def route(router_logits: torch.Tensor, top_k: int, *, scoring_func: str, topk_method: str, n_group: int,
          topk_group: int, correction_bias: torch.Tensor | None, norm_topk_prob: bool,
          routed_scaling_factor: float, n_shared: int = 0, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as select_experts: (weights (T, k + n_shared) fp32, ids (T, k + n_shared) int64 ascending
    per token). pdl: a programmatic dependent launch."""
    t, e = router_logits.shape
    method = METHODS[topk_method]
    groups = n_group if method != GREEDY else 1
    logits = router_logits.contiguous()
    weights = torch.empty(t, top_k + n_shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k + n_shared, dtype=torch.int64, device=logits.device)
    if t:
        bias = correction_bias if correction_bias is not None else logits
        _route_kernel[(t,)](logits, bias, weights, ids, ids, ids, logits.stride(0), 0, float(routed_scaling_factor),
                            G=groups, EG=e // groups, BG=triton.next_power_of_2(groups),
                            BEG=triton.next_power_of_2(e // groups), K=top_k, KP=triton.next_power_of_2(top_k),
                            KEEP_GROUPS=topk_group if method != GREEDY else 1, SCORING=SCORINGS[scoring_func],
                            METHOD=method, NORM=norm_topk_prob, SHARED=n_shared,
                            SP=max(2, triton.next_power_of_2(n_shared)), HASH=False, num_warps=1, **pdl_launch(pdl))
    return weights, ids


def route_hashed(router_logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor, *, scoring_func: str,
                 norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4's first layers): token t's experts are table[token_ids[t]] (k of them, in the
    table's order), weighted by their scores (normalized over the k, then scaled): (weights (T, k) fp32, ids (T, k)
    int64), one launch."""
    t, e = router_logits.shape
    k = table.shape[1]
    logits = router_logits.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if table.stride(1) != 1:
        table = table.contiguous()
    if t:
        _route_kernel[(t,)](logits, logits, weights, ids, token_ids, table, logits.stride(0), table.stride(0),
                            float(routed_scaling_factor), G=1, EG=e, BG=1, BEG=triton.next_power_of_2(e), K=k,
                            KP=triton.next_power_of_2(k), KEEP_GROUPS=1, SCORING=SCORINGS[scoring_func],
                            METHOD=GREEDY, NORM=norm_topk_prob, SHARED=0, SP=2, HASH=True, num_warps=1,
                            PDL=False)
    return weights, ids
