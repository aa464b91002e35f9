"""Mixture-of-experts block (DeepSeek-V2/V3): router, routed experts, shared experts.

    mlp.gate.weight (E, H), mlp.gate.e_score_correction_bias (E,)   router, kept in fp32 like HF
    mlp.experts.gate_up_proj (E, 2I, H) = per expert [gate; up]     the fused HF v5 layout
    mlp.experts.down_proj (E, H, I)
    mlp.shared_experts.{gate,up,down}_proj                          a dense gated MLP of n_shared * I

Checkpoints store experts either fused (the names above) or per expert (`experts.{e}.gate_proj.weight`, what
`save_pretrained` and the DeepSeek releases write); `fuse_expert_weights` turns the latter into the former.

Methods, chosen from the KernelConfig at construction: the router GEMM (RouterGemm: the layer's linear method;
TritonRouterGemm), the routing (TorchRouting: select_experts; TritonRouting: one kernel) and the experts
(TorchExperts: a loop over the experts hit; FusedExperts: the Triton fused MoE, batch-invariant tiles or not).
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.layers.expert_weights import expert_weights_method, joint_expert_weights, joint_fp8_expert_weights
from deepinfer_rt.layers.fp8 import Fp8BlockExperts, apply_keeping_quantized, is_fp8_fused_experts
from deepinfer_rt.layers.kernel_config import KernelConfig, current_kernel_config
from deepinfer_rt.layers.methods import Activation, LinearMethod, activation_method, linear_method
from deepinfer_rt.layers.mlp import GatedMLP

FUSED_SHARED_MAX_TOKENS = 512
"""Most rows for which the shared experts run inside the fused MoE (MoE.process_weights_after_loading); in
batch-invariant mode they always do, so that a row's bits do not depend on the batch's size."""
ROUTER_KERNEL_ROWS = (64, 256)
"""Batch sizes at which the router GEMM runs as one Triton launch (kernels/router_gemm.py), for routers of up to
ROUTER_KERNEL_MAX_WEIGHT elements. In V2-Lite's decode steps on an H200 (router 64 x 2048, bench_gpu.py profiles)
it took 8.0 / 8.7 us at 64 / 256 rows against ~9 / ~12 us for cast + cuBLAS, but 9.1 us at 1 / 16 rows against
~5 / ~7 us (its weight tiles stream from DRAM one after another); prefill sizes and larger routers are slower."""
ROUTER_KERNEL_MAX_WEIGHT = 1 << 17
ROUTER_PIECES_MIN_ROWS = 512
"""From this many bf16 rows up the router GEMM runs on tensor cores over the weight's three bf16 pieces
(kernels/router_gemm.router_logits_bf16: products exact in fp32, so fp32 logits), instead of a cast of x to
fp32 and an fp32 cuBLAS sgemm (3% of a V2-Lite 8K-token prefill on an H200). Graph-timed on an H200
(bench_kernels.py --only router, results/gpu_router_h200.json): ~18 us at every T up to 8192 for V2-Lite's
64 x 2048 router against 11.6 / 22.8 / 108 us of cast + cuBLAS at T = 256 / 1024 / 8192; V3's 256 x 7168:
59-61 us up to T = 1024, 208 us at 8192 against 40 / 114 / 748 us."""


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                   topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                   correction_bias: torch.Tensor | None = None, norm_topk_prob: bool = False,
                   routed_scaling_factor: float = 1.0, n_shared: int = 0,
                   sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> (weights (T, k') fp32, expert ids (T, k') int64, ascending per token), k' = k +
    n_shared.

    Scores are softmax or sigmoid of the logits. Experts are chosen on the scores, plus correction_bias for
    'noaux_tc' (the bias balances load: it steers the choice but never enters the weights), by
      greedy                top-k over all experts;
      group_limited_greedy  (V2) top-k within the topk_group groups whose best expert scores highest;
      noaux_tc              (V3) top-k within the topk_group groups whose two best experts sum highest.
    The weights are the chosen experts' unbiased scores, renormalised to sum 1 if norm_topk_prob, times
    routed_scaling_factor. Ids come sorted so that experts are combined in a fixed order. n_shared > 0 appends
    the shared experts as ids E..E+n_shared-1 of weight 1 (MoE.process_weights_after_loading). `sigmoid` is the
    activation method's (batch-invariant mode rebuilds it from exp). The torch form (TorchRouting); on CUDA
    TritonRouting runs it as one kernel.
    """
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = sigmoid(logits)
    else:
        raise ValueError(f"unknown MoE scoring_func {scoring_func!r}")
    choice = scores
    if topk_method == "noaux_tc":
        if correction_bias is None:
            raise ValueError("topk_method 'noaux_tc' needs the e_score_correction_bias")
        choice = scores + correction_bias.float()
    if topk_method in ("group_limited_greedy", "noaux_tc"):
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        if topk_method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values  # (T, G)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // n_group, dim=1), float("-inf"))
    elif topk_method != "greedy":
        raise ValueError(f"unknown MoE topk_method {topk_method!r}")
    ids = choice.topk(top_k, dim=-1).indices.sort(dim=-1).values
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    if n_shared:
        t, e = choice.shape
        shared = torch.arange(e, e + n_shared, device=ids.device).expand(t, n_shared)
        ids, weights = torch.cat([ids, shared], dim=1), torch.cat([weights, weights.new_ones(t, n_shared)], dim=1)
    return weights, ids


class TorchRouting:
    """select_experts in torch (with the config's sigmoid)."""

    def __init__(self, activation: Activation):
        self.activation = activation

    def __call__(self, router_logits: torch.Tensor, top_k: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, top_k, sigmoid=self.activation.sigmoid, **kw)


class TritonRouting(TorchRouting):
    """One routing kernel instead of about seven small ones, for the scorings and top-k methods it covers. It
    computes each token in its own program with tiles fixed by E and k: batch-invariant too. pdl: a programmatic
    dependent launch (KernelConfig.uses_pdl)."""

    def __init__(self, activation: Activation, pdl: bool = False):
        super().__init__(activation)
        self.pdl = pdl

    def __call__(self, router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "softmax",
                 topk_method: str = "greedy", correction_bias: torch.Tensor | None = None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
                 **kw) -> tuple[torch.Tensor, torch.Tensor]:
        kw.update(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                  routed_scaling_factor=routed_scaling_factor)  # select_experts' defaults, which the kernel lacks
        if (scoring_func in ("softmax", "sigmoid") and topk_method in ("greedy", "group_limited_greedy", "noaux_tc")
                and (topk_method != "noaux_tc" or correction_bias is not None)):
            from deepinfer_kernels.moe_router import route

            return route(router_logits, top_k, scoring_func=scoring_func, topk_method=topk_method,
                         correction_bias=correction_bias, pdl=self.pdl, **kw)
        return super().__call__(router_logits, top_k, scoring_func=scoring_func, topk_method=topk_method,
                                correction_bias=correction_bias, **kw)


def routing_method(config: KernelConfig) -> TorchRouting:
    if config.is_triton:
        return TritonRouting(activation_method(config), config.uses_pdl)
    return TorchRouting(activation_method(config))


class RouterGemm:
    """Router logits (T, E) fp32 = x.float() @ weight.T through a linear method (batch-invariant or not)."""

    def __init__(self, linear: LinearMethod):
        self.linear = linear

    def apply(self, router: Router, x: torch.Tensor) -> torch.Tensor:
        return self.linear.linear(x.float(), router.weight)

    def process_weights_after_loading(self, router: Router) -> None:
        pass


class TritonRouterGemm(RouterGemm):
    """CUDA, not batch-invariant: by batch size, the one-launch router kernel (ROUTER_KERNEL_ROWS), tensor cores
    over the weight's bf16 pieces (ROUTER_PIECES_MIN_ROWS), else cast + cuBLAS."""

    def apply(self, router: Router, x: torch.Tensor) -> torch.Tensor:
        lo, hi = ROUTER_KERNEL_ROWS
        if lo <= x.shape[0] <= hi and router.weight.numel() <= ROUTER_KERNEL_MAX_WEIGHT:
            from deepinfer_kernels.router_gemm import router_logits

            return router_logits(x, router.weight)  # one launch that reads x in its own dtype
        if (router.weight_pieces is not None and x.dtype == torch.bfloat16 and x.shape[0] >= ROUTER_PIECES_MIN_ROWS
                and x.stride(-1) == 1):
            from deepinfer_kernels.router_gemm import router_logits_bf16

            return router_logits_bf16(x, router.weight_pieces)
        return super().apply(router, x)

    def process_weights_after_loading(self, router: Router) -> None:
        from deepinfer_kernels.router_gemm import split_weight

        router.weight_pieces = split_weight(router.weight.data)


def router_gemm_method(config: KernelConfig) -> RouterGemm:
    if config.is_triton and not config.is_batch_invariant:
        return TritonRouterGemm(linear_method(config))
    return RouterGemm(linear_method(config))


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        kernel_config = current_kernel_config()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
            if config.topk_method == "noaux_tc" else None)
        skew = kernel_config.moe_router_skew
        # Benchmarks only: a Zipf-like preference for low expert ids, p(e) ~ (1 + e)^-skew under softmax.
        self.skew_bias = -skew * torch.arange(1, e + 1, dtype=torch.float32).log() if skew else None
        self.method = router_gemm_method(kernel_config)
        self.weight_pieces: torch.Tensor | None = None
        """bf16 (3, E, H), hi + mid + lo = weight: set on GPU by `process_weights_after_loading`, dropped by any
        `.to()`. A copy, not a view: a weight changed in place afterwards needs `process_weights_after_loading`
        (models.loader.finalize) again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, x)  # (T, E) fp32
        if self.skew_bias is not None:
            logits = logits + self.skew_bias.to(logits.device)
        return logits

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def _apply(self, fn, recurse=True):
        self.weight_pieces = None  # moved: rebuilt by process_weights_after_loading
        # HF keeps the router in fp32 (_keep_in_fp32_modules_strict): in bf16 the correction bias (entries
        # ~1e-2 apart on scores near 0.5) would change which experts win. Follow device moves, not dtype casts.
        fp32 = {name: p.data for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, data in fp32.items():
            self._parameters[name].data = data.to(self._parameters[name].device)
        return self


class ExpertsMethod:
    """sum_k weights * expert_ids(x): x (T, H), gate_up (E, 2I, H), down (E, H, I), weights/ids (T, k) -> (T, H)."""

    is_joint_shared = False
    """Whether the shared experts join the routed ones in one launch (MoE.process_weights_after_loading)."""

    def apply(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_experts(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """`apply` over a RoutedExperts' own tensors (a quantized method also reads their scales)."""
        return self.apply(x, experts.gate_up_proj, experts.down_proj, weights, ids)

    def apply_joint(self, x: torch.Tensor, joint: tuple[torch.Tensor, ...], weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        """`apply` over MoE.joint_experts (gate_up, down; a quantized method's hold their scales too)."""
        return self.apply(x, *joint, weights, ids)

    def fuses_shared(self, num_tokens: int) -> bool:
        """Whether a batch of this many rows runs the shared experts inside the routed launch."""
        return False

    def padding_slot(self, num_experts: int) -> int:
        """The expert id of a padding row in a fixed-size call (expert parallelism's capture-safe exchange,
        distributed/ep.py), whose result is never read: expert 0 here, computed (the fused kernels give each row
        a result of its own inputs only, whatever rows share its tile)."""
        return 0


class TorchExperts(ExpertsMethod):
    """Torch reference: (token, slot) pairs are sorted by expert, each expert that received tokens runs one
    matmul over its contiguous rows, and the k results of a token are summed in slot (= expert id) order; in
    batch-invariant mode as ordered adds, one rounding per add, whatever the expert loads."""

    def __init__(self, linear: LinearMethod, activation: Activation, is_ordered_sum: bool):
        self.linear, self.activation, self.is_ordered_sum = linear, activation, is_ordered_sum

    def apply(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        linear, act = self.linear.linear, self.activation.silu_and_mul
        t, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (T*k,) pair indices grouped by expert; padding ids (E) last
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        xs = x[order // k]  # (T*k, H)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts[:gate_up.shape[0]]):
            if n:
                rows = slice(start, start + n)
                ys[rows] = linear(act(linear(xs[rows], gate_up[e])), down[e])
            start += n
        ys[start:] = 0  # padding rows (`padding_slot`)
        out = torch.empty_like(ys)
        out[order] = ys  # back to (token, slot) order
        out, weights = out.view(t, k, -1), weights.unsqueeze(-1)
        if not self.is_ordered_sum:
            return (out * weights).sum(dim=1).to(x.dtype)
        y = out[:, 0] * weights[:, 0]
        for j in range(1, k):
            y = y + out[:, j] * weights[:, j]
        return y.to(x.dtype)

    def padding_slot(self, num_experts: int) -> int:
        """Id E, one past the experts: skipped, so each expert's matmul runs over exactly its own rows."""
        return num_experts


class FusedExperts(ExpertsMethod):
    """The Triton fused MoE (batch-invariant tiles in batch-invariant mode). Batches of up to
    FUSED_SHARED_MAX_TOKENS rows (any batch in batch-invariant mode) take the shared experts in the same launch.
    pdl: its launches programmatic dependent ones (KernelConfig.uses_pdl)."""

    is_joint_shared = True

    def __init__(self, is_batch_invariant: bool, pdl: bool = False):
        self.is_batch_invariant = is_batch_invariant
        self.pdl = pdl

    def apply(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        from deepinfer_kernels.fused_moe import fused_moe

        return fused_moe(x.contiguous(), gate_up, down, weights, ids, batch_invariant=self.is_batch_invariant,
                         pdl=self.pdl)

    def fuses_shared(self, num_tokens: int) -> bool:
        return num_tokens <= FUSED_SHARED_MAX_TOKENS or self.is_batch_invariant


class Fp8FusedExperts(ExpertsMethod):
    """The FP8 fused MoE (deepinfer_kernels.fused_moe_fp8): float8 experts with float32 block scales, activations
    quantized once per token (per pair for down) and block[1] channels (W8A8); batch-invariant mode runs its one
    fixed configuration. As with FusedExperts, batches of up to FUSED_SHARED_MAX_TOKENS rows (any batch in
    batch-invariant mode) take FP8 shared experts in the same launch (joint_fp8_expert_weights)."""

    is_joint_shared = True

    def __init__(self, block: tuple[int, int], is_batch_invariant: bool = False, pdl: bool = False):
        self.block = block
        self.is_batch_invariant = is_batch_invariant
        self.pdl = pdl
        """The kernels as programmatic dependent launches (KernelConfig.uses_pdl)."""
        self.tiled = False
        """Whether this layer's experts (and the joint tensors) are in fused_moe_fp8's TILED layout, set where
        layers/fp8.py Fp8BlockExperts reorders them at load (DEEPINFER_FP8_MOE_TILES)."""

    def apply_experts(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        return self.apply_joint(x, (experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj,
                                    experts.down_proj_scale_inv), weights, ids)

    def apply_joint(self, x: torch.Tensor, joint: tuple[torch.Tensor, ...], weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8

        return fused_moe_fp8(x.contiguous(), *joint, weights, ids, self.block, batch_invariant=self.is_batch_invariant,
                             pdl=self.pdl, tiled=self.tiled)

    def fuses_shared(self, num_tokens: int) -> bool:
        return num_tokens <= FUSED_SHARED_MAX_TOKENS or self.is_batch_invariant


def experts_method(config: KernelConfig) -> ExpertsMethod:
    if is_fp8_fused_experts(config):
        return Fp8FusedExperts(config.weight_block_size, config.is_batch_invariant, config.uses_pdl)
    if config.is_triton:
        return FusedExperts(config.is_batch_invariant, config.uses_pdl)
    return TorchExperts(linear_method(config), activation_method(config), config.is_batch_invariant)


class RoutedExperts(nn.Module):
    cast_as_built = True  # models/loader._cast_as_built: to the model dtype as soon as built (dummy weights)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        kernel_config = current_kernel_config()
        self.method = experts_method(kernel_config)
        self.weights_method = (
            Fp8BlockExperts(kernel_config.weight_block_size, kernel_config.is_checkpoint_quantized,
                            kernel_config.scale_fmt)
            if is_fp8_fused_experts(kernel_config) else expert_weights_method(kernel_config))
        """How the fused weights are held (layers/fp8.py: FP8 checkpoints add their scales; kept FP8 for the FP8
        fused MoE, else dequantized at load)."""
        self.weights_method.create_weights(self)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, H), weights/ids (T, k) -> sum_k weights * expert_ids(x) (T, H) (the method's docstring)."""
        return self.method.apply_experts(self, x, weights, ids)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        self.weights_method.process_weights_after_loading(self)

    def _apply(self, fn, recurse=True):
        return apply_keeping_quantized(self, fn, lambda f: super(RoutedExperts, self)._apply(f, recurse))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts = RoutedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts else None)
        self.routing = routing_method(current_kernel_config())
        self.expert_parallel = None
        """In an expert-parallel worker, the hook that runs routed and shared experts across the EP group
        (deepinfer_rt/distributed/ep.py); `experts` then holds only this rank's slots."""

        self.joint_experts: tuple[torch.Tensor, ...] | None = None
        """(gate_up (E + S, 2I, H), down (E + S, H, I)): the routed experts followed by the S shared experts of
        width I, set on GPU by `process_weights_after_loading` (experts.gate_up_proj / down_proj are views of
        their first E experts) and dropped by any `.to()`; FP8 experts: (gate_up, its scales, down, its scales)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        fused = (self.joint_experts is not None and self.expert_parallel is None
                 and self.experts.method.fuses_shared(x.shape[0]))
        weights, ids = self.routing(
            self.gate(x), c.num_experts_per_tok, scoring_func=c.scoring_func, topk_method=c.topk_method,
            n_group=c.n_group, topk_group=c.topk_group, correction_bias=self.gate.e_score_correction_bias,
            norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
            n_shared=c.n_shared_experts if fused else 0)
        if self.expert_parallel is not None:
            return self.expert_parallel(self, x, weights, ids)
        if fused:
            return self.experts.method.apply_joint(x, self.joint_experts, weights, ids)
        y = self.experts(x, weights, ids)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """With the fused experts (GPU), append the shared experts to the routed ones (`joint_expert_weights`)
        so that batches of up to FUSED_SHARED_MAX_TOKENS rows run both in one fused-MoE launch pair. This saves
        the shared MLP's GEMMs, activation and residual add (four launches per layer at decode). The routed
        parameters become views of the joint tensors (no second copy); the shared MLP keeps its weights for
        longer batches, where its dense GEMMs run faster than the grouped kernel. Called once the weights are
        final and on their device (models.loader.finalize, after the experts' own); a `.to()` drops the joint tensors, and a weight
        reload must call it again. The shared experts' weights are held twice (~0.9 GB for V2-Lite in bf16)."""
        if (self.shared_experts is None or self.expert_parallel is not None
                or not self.experts.method.is_joint_shared):
            return
        e, n_shared = self.experts.num_experts, self.config.n_shared_experts
        if isinstance(self.experts.method, Fp8FusedExperts):
            joint = joint_fp8_expert_weights(self.experts, self.shared_experts, n_shared, self.experts.method.block)
            if joint is None:
                return
            if self.experts.method.tiled:  # the routed part is tiled already; the shared part as it
                from deepinfer_kernels.fused_moe_fp8 import tile_experts

                for w in (joint[0][e:], joint[2][e:]):
                    tile_experts(w, self.experts.method.block[1], out=w)
            names = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
        elif self.shared_experts.gate_up_proj.method.is_quantized:  # quantized shared experts, 16-bit routed ones
            return
        else:
            joint = joint_expert_weights(self.experts, self.shared_experts, n_shared)
            names = ("gate_up_proj", "down_proj")
        for name, tensor in zip(names, joint):
            getattr(self.experts, name).data = tensor[:e]
        self.joint_experts = joint

    def _apply(self, fn, recurse=True):
        self.joint_experts = None  # moved or cast: the routed parameters are no longer views of them
        return super()._apply(fn, recurse)


_PER_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight(?P<suffix>_scale_inv)?")


def fuse_expert_weights(weights: Iterable[tuple[str, torch.Tensor]],
                        num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass checkpoint tensors through, replacing each layer's per-expert tensors by the fused
    `experts.gate_up_proj` / `experts.down_proj` once all of that layer's experts have been read (a layer may
    span shard files, so only the current incomplete layers are held). FP8 checkpoints' per-expert
    `weight_scale_inv` fuse the same way, to `experts.gate_up_proj_scale_inv` / `experts.down_proj_scale_inv`
    (gate's scale blocks, then up's)."""
    pending: dict[tuple[str, str], dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in weights:
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        prefix, suffix = m["prefix"], m["suffix"] or ""
        layer = pending.setdefault((prefix, suffix), {})
        layer[(m["proj"], int(m["expert"]))] = tensor
        if len(layer) < 3 * num_experts:
            continue
        del pending[(prefix, suffix)]
        shapes = {proj: {tuple(t.shape) for (p, _), t in layer.items() if p == proj} for proj, _ in layer}
        if (any(len(s) > 1 for s in shapes.values())
                or {s[1:] for s in shapes["gate_proj"]} != {s[1:] for s in shapes["up_proj"]}):
            raise ValueError(f"{prefix}: per-expert{suffix} tensors of unequal shapes {shapes} (every expert's "
                             "alike, and gate's and up's columns)")
        experts = range(num_experts)
        gate = torch.stack([layer[("gate_proj", e)] for e in experts])  # (E, I, H)
        up = torch.stack([layer[("up_proj", e)] for e in experts])
        yield f"{prefix}.gate_up_proj{suffix}", torch.cat([gate, up], dim=1)  # (E, 2I, H)
        yield f"{prefix}.down_proj{suffix}", torch.stack([layer[("down_proj", e)] for e in experts])  # (E, H, I)
    if pending:
        (prefix, suffix), layer = next(iter(pending.items()))
        raise ValueError(f"checkpoint has {len(layer)} of the {3 * num_experts} per-expert{suffix} tensors of "
                         f"{prefix}")
