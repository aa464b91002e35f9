"""DeepSeek-V4.1's DSpark draft network (the checkpoint's `mtp.{s}.*` stages), as plain batched torch.

What it computes, for R requests at once (the drafter in dspark.py gathers the inputs and samples the outputs):

    features   f_p = concat over dspark_target_layer_ids of mean_streams(input of that target layer at position p),
               captured during the target's own forward (after Engram, before the layer's attention pre-mix)
    context    main_x_p = main_norm(main_proj(f_p)) (stage 0's projection, shared by every stage);
               per stage s: key_p^s = RoPE_p(kv_norm(wkv^s(main_x_p))) on the stage's plain-RoPE (rope_theta)
               table; stored once per position (dspark.py keeps them in a pool layer), K = V as in the target
    block      ids [bonus, noise, ..., noise] (dspark_block_size B) at positions s+1 .. s+B, s = the last position
               with target features; embedded with the target's embedding, expanded to hc_mult streams, one-hot
               carried pre-mix on stream 0
    stage s    shifted mHC sublayers as the target's: attention, then MoE (the draft's own expert bank).
               Attention: q = wq_b(q_norm(wq_a(x))) (no per-head q norm, no indexer part), block keys
               RoPE(kv_norm(wkv(x))); every block row attends to the last sliding_window context keys (positions
               <= s) and to all B block keys (non-causal inside the block), per-head sinks, scale head_dim^-0.5,
               the output's RoPE undone, grouped wo_a then wo_b
    head       h = the last carried pre-mix applied to the streams; base logits = target head(norm(h));
               row i: logits_i = base_i + markov_head.head(markov_head.embed(prev_i)), prev_0 = bonus and
               prev_i = the token drawn at row i-1 (rows drawn in order); confidence_i =
               confidence_head.proj([h_i ; markov_head.embed(prev_i)]) (a raw logit; sigmoid = the predicted
               probability that drafts 1 .. i all survive verification)

Weight names (release and HF checkpoints alike, below `mtp.{s}.`): attn_norm / ffn_norm `.weight`,
hc_attn_{fn,base,scale}, hc_ffn_{fn,base,scale}, attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b}.weight,
attn.attn_sink, ffn.gate.{weight, bias}, ffn.experts.{e}.w{1,2,3}.weight, ffn.shared_experts.w{1,2,3}.weight;
stage 0 only: main_proj.weight, main_norm.weight; the last stage only: norm.weight, markov_head.embed.weight
(V, r), markov_head.head.weight (V, r), confidence_head.proj.weight (1, hidden + r). Embedding and vocabulary
head are the target's (the checkpoint has no draft copies).

Sources read (public; nothing copied): TensorRT-LLM tensorrt_llm/_torch/models/modeling_dspark.py
(DSv4DSparkDraftModel: forward_embed, _forward_stage, forward_head, dspark_attention_forward, write_context_windows),
modeling_dspark_v41.py (V4.1: lagged pre-mix, no HC head, no q head norm, the draft expert bank, `markov_head.embed`
/ `.head` -> markov_w1 / w2), speculative/dspark.py (target-layer capture = mean over the mHC streams, rolling
windows seeded from the prompt and back-filled with accepted positions), a port of the release's
inference/model.py (DSparkBlock.forward_embed / forward_head, DSparkAttention, Transformer.forward_spec) and the
DeepSpec confidence head readers (sigmoid(logit) as prefix survival, `confident_prefix_length`). The deepinfer
0.1.0 sdist (mtp/dflash.py, mtp_varlen.hpp) could not be fetched here (not on the package index this build uses).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import GroupedLinear, Linear
from deepinfer_rt.layers.methods import linear_method
from deepinfer_rt.layers.moe import fuse_expert_weights
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.deepseek_v4.common import V4RMSNorm, V4Rotary
from deepinfer_rt.models.deepseek_v4.methods import apply_rope
from deepinfer_rt.models.deepseek_v4.hyper_connections import HyperConnection
from deepinfer_rt.models.deepseek_v4.model import _FP32 as TARGET_FP32
from deepinfer_rt.models.deepseek_v41.config import V41Config
from deepinfer_rt.models.deepseek_v41.methods import v41_method
from deepinfer_rt.models.deepseek_v41.model import V41MoE
from deepinfer_rt.models.release_names import from_release_name

_RENAMES = ((re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
            (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
            (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
            (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."))
_STAGE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_SHARED_HALF = re.compile(r"\.shared_experts\.(w1|w3)\.")


def draft_config(cfg: V41Config) -> V41Config:
    """The target's config with the draft stages' expert bank; ValueError when the checkpoint has no drafter."""
    if cfg.dspark_block_size < 1 or cfg.num_nextn_predict_layers < 1 or not cfg.dspark_target_layer_ids:
        raise ValueError("speculative='dspark' needs a DeepSeek-V4.1 checkpoint with DSpark layers "
                         "(num_nextn_predict_layers >= 1, dspark_block_size >= 1, dspark_target_layer_ids)")
    if not cfg.hc_shifted:
        raise ValueError("speculative='dspark': the drafter runs on shifted mHC checkpoints only (hc_shifted)")
    e = cfg.dspark_n_routed_experts or cfg.n_routed_experts
    k = cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok
    if not 1 <= k <= e:
        raise ValueError(f"DSpark: {k} experts per token from a bank of {e}")
    return dataclasses.replace(cfg, n_routed_experts=e, num_experts_per_tok=k)


class DSparkAttention(nn.Module):
    def __init__(self, cfg: V41Config, rotary: V4Rotary):
        super().__init__()
        h, d = cfg.num_heads, cfg.head_dim
        self.cfg, self.rotary, self.num_heads, self.head_dim = cfg, rotary, h, d
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * d)
        self.wkv = Linear(cfg.hidden_size, d)
        self.kv_norm = V4RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(h))
        self.method = v41_method(current_kernel_config())
        """Default or batch-invariant block attention and products (models/deepseek_v41/methods.py)."""

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N, hidden) inputs at `positions` -> (N, head_dim) rotated keys (= values)."""
        cos, sin = self.rotary.cos_sin(positions)
        return apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor
                ) -> torch.Tensor:
        """x (R*B, hidden) block rows, request after request; ctx (R, L, D) context keys, ctx_mask (R, L)."""
        r, num_ctx, _ = ctx.shape
        h, d, t = self.num_heads, self.head_dim, x.shape[0]
        b = t // r
        cos, sin = self.rotary.cos_sin(positions)
        q = apply_rope(self.wq_b(self.q_norm(self.wq_a(x))).view(t, h, d), cos, sin)  # V4.1: no per-head q norm
        block = apply_rope(self.kv_norm(self.wkv(x)), cos, sin).view(r, b, d)
        out = self.method.draft_attend(q.view(r, b, h, d), ctx.to(x.dtype), ctx_mask, block, self.attn_sink)
        out = apply_rope(out, cos, -sin)
        grouped = self.wo_a.project(out.reshape(t, self.cfg.o_groups, -1), self.method.v4.grouped_projection)
        return self.wo_b(grouped.reshape(t, -1))


class DSparkStage(nn.Module):
    """One draft stage. In a release checkpoint the attention, shared and routed experts are quantized like the
    target's layers (FP8 32 x 32, MXFP4 experts); main_proj takes the quantized method where the checkpoint ships
    its scale (main_proj_fp8; V4's MTP e_proj ships one); the Markov and confidence heads stay 16-bit."""

    def __init__(self, cfg: V41Config, rotary: V4Rotary, stage: int, num_stages: int, main_proj_fp8: bool = True):
        super().__init__()
        kept = linear_method(current_kernel_config())
        hidden, rank = cfg.hidden_size, cfg.dspark_markov_rank
        self.attn = DSparkAttention(cfg, rotary)
        self.ffn = V41MoE(cfg)
        self.attn_norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        if stage == 0:
            self.main_proj = Linear(hidden * len(cfg.dspark_target_layer_ids), hidden,
                                    method=None if main_proj_fp8 else kept)
            self.main_norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        if stage == num_stages - 1:
            self.norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(cfg.vocab_size, rank)
            self.markov_head.head = Linear(rank, cfg.vocab_size, method=kept)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = Linear(hidden + rank, 1, method=kept)

    @staticmethod
    def _sublayer(hc: HyperConnection, streams, carried, block):
        """Shifted mHC: the input applies the previous sublayer's pre-mix; this one's is handed on."""
        pre, post, comb = hc.weights(streams)
        dtype = streams.dtype
        y = block(hc.method.middle_sum(carried.unsqueeze(-1) * streams, dim=1).to(dtype))
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + hc.method.hc_mix(comb.to(dtype), streams), pre

    def forward(self, streams, carried, positions, ctx, ctx_mask, ids):
        streams, carried = self._sublayer(self.hc_attn, streams, carried,
                                          lambda x: self.attn(self.attn_norm(x), positions, ctx, ctx_mask))
        return self._sublayer(self.hc_ffn, streams, carried, lambda x: self.ffn(self.ffn_norm(x), ids))


class DSparkModel(CausalLM):
    """The draft stages over the target's embedding and head (held in a tuple: they stay the target's)."""

    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig, target, main_proj_fp8: bool = True):
        super().__init__(config)
        cfg = draft_config(target.v41)
        self.cfg, self._target = cfg, (target,)
        self.num_stages, self.block_size = cfg.num_nextn_predict_layers, cfg.dspark_block_size
        self.noise_token_id = cfg.vocab_size - 1 if cfg.dspark_noise_token_id is None else cfg.dspark_noise_token_id
        rotary = V4Rotary(cfg, cfg.rope_main)  # the draft's attention is ratio 0: plain rope_theta
        self.stages = nn.ModuleList(DSparkStage(cfg, rotary, s, self.num_stages, main_proj_fp8)
                                    for s in range(self.num_stages))
        self.method = v41_method(current_kernel_config())

    def _apply(self, fn, recurse=True):
        # Follow device moves but not dtype casts where the target keeps fp32 (deepseek_v4/model.py _FP32: norm
        # gains, attention sinks, the router's correction bias, the mHC weights), as the reference drafter does.
        fp32 = {n: p.data for n, p in self.named_parameters() if TARGET_FP32.search(n) and p.dtype == torch.float32}
        super()._apply(fn, recurse)
        params = dict(self.named_parameters())
        for name, data in fp32.items():
            params[name].data = data.to(params[name].device)
        return self

    @property
    def key_width(self) -> int:
        """Pool columns per position: every stage's context key."""
        return self.num_stages * self.cfg.head_dim

    def context_keys(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N, targets * hidden) captured features at `positions` -> (N, stages * head_dim) keys, stage after stage."""
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(features.to(first.main_proj.weight.dtype)))
        return torch.cat([stage.attn.keys(main_x, positions) for stage in self.stages], dim=-1)

    def forward(self, ctx: torch.Tensor, ctx_mask: torch.Tensor, bonus: torch.Tensor, first_position: torch.Tensor
                ) -> torch.Tensor:
        """ctx (R, L, stages * head_dim) context keys, ctx_mask (R, L), bonus (R,) the last sampled tokens at
        first_position (R,). Returns (R, B, hidden): the block rows' collapsed hidden (before the final norm)."""
        r, b, n = bonus.shape[0], self.block_size, self.cfg.hc_mult
        ids = bonus.new_full((r, b), self.noise_token_id)
        ids[:, 0] = bonus
        ids = ids.flatten()
        positions = (first_position[:, None] + torch.arange(b, device=bonus.device)).flatten()
        x = self._target[0].model.embed_tokens(ids)
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        carried = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        carried[:, 0] = 1.0
        d = self.cfg.head_dim
        for s, stage in enumerate(self.stages):
            streams, carried = stage(streams, carried, positions, ctx[..., s * d : (s + 1) * d], ctx_mask, ids)
        hidden = self.method.v4.middle_sum(carried.unsqueeze(-1) * streams.float(), dim=1).to(streams.dtype)
        return hidden.view(r, b, -1)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(self.stages[-1].norm(hidden))

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R,) previous tokens -> (R, V) logit correction, (R, rank) their Markov embeddings."""
        head = self.stages[-1].markov_head
        e = head.embed(prev)
        return head.head(e).float(), e

    def confidence(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """(R, hidden), (R, rank) -> (R,) fp32 confidence logits."""
        proj = self.stages[-1].confidence_head.proj
        features = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1).float()
        return self.method.matmul(features, proj.weight.float())[:, 0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = from_release_name(name)  # `.scale` -> `.weight_scale_inv`
                m = _STAGE.match(name)
                if m is None or int(m[1]) >= self.num_stages:
                    continue
                name = f"stages.{m[1]}.{m[2]}"
                for pattern, repl in _RENAMES:
                    name = pattern.sub(repl, name)
                yield name, tensor

        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in fuse_expert_weights(renamed(), self.cfg.n_routed_experts):
            half = _SHARED_HALF.search(name)  # the shared expert's w1 / w3: a shard of its merged w13
            if half is not None:
                name = name.replace(half[0], ".shared_experts.w13.")
            if name not in params:
                raise ValueError(f"DSpark checkpoint tensor {name!r} has no parameter in the drafter")
            loader = getattr(params[name], "weight_loader", None)
            if half is not None or loader is not None:  # a shard, or a parameter that checks what it reads
                try:
                    loader(params[name], tensor, half[1]) if half is not None else loader(params[name], tensor)
                except ValueError as e:
                    raise ValueError(f"DSpark {name}: {e}") from e
            elif tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"DSpark {name}: checkpoint shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}")
            else:
                with torch.no_grad():
                    params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"DSpark checkpoint lacks {len(missing)} drafter tensors, e.g. {missing[:4]}")
