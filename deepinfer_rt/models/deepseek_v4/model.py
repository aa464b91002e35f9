"""DeepSeek-V4 (V4-Flash / V4-Pro layout): per-layer sliding-window, compressed-sparse (CSA) or heavily
compressed (HCA) attention, hyper-connection residual streams, hash-routed then learned-routed MoE.

Module names follow the released checkpoints (what transformers' save_pretrained writes back): attn, ffn,
attn_norm, ffn_norm, hc_attn_*, hc_ffn_*, hc_head, head; the releases' own spelling (layers.N.*, embed.weight,
`.scale`: models/release_names.py) loads too, with FP8 / MXFP4 weights (layers/quant_formats.py).
Multi-token-prediction weights (mtp.*) are not run.
What the KV pool keeps per token and layer is described in models/deepseek_v4/common.py.

Not covered (the V4.1 line): compression ratios 1 and 2, shifted hyper-connections, cross-layer KV sharing,
YOCO, Engram, and the DSpark draft model.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.env import get_env
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead
from deepinfer_rt.layers.moe import fuse_expert_weights
from deepinfer_rt.models.deepseek_v4.attention import V4Attention
from deepinfer_rt.models.deepseek_v4.batch import V4Batch, build_v4_batch
from deepinfer_rt.models.deepseek_v4.cache import V4KVLayout, V4Pool
from deepinfer_rt.models.deepseek_v4.common import (SLIDING, PoolColumns, V4Config, V4RMSNorm, V4Rotary,
                                                   recent_tokens, shared_tables)
from deepinfer_rt.models.deepseek_v4.graph_batch import StaticDecode
from deepinfer_rt.models.deepseek_v4.moe import V4MoE, V4Router
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.release_names import from_release_name

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Kept in fp32 whatever the model dtype, as the reference does: norm gains, attention sinks, compressor position
# biases, the router correction bias and the hyper-connection weights.
_FP32 = re.compile(r"(norm\.weight|attn_sink|\.ape|gate\.bias|\.hc_(attn|ffn)\.\w+|hc_head\.\w+)$")
_RENAMES = ((re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
            (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
            (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
            (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."))


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int, rotary: V4Rotary, vocab_size: int):
        super().__init__()
        self.attn = V4Attention(cfg, layer_id, rotary)
        self.ffn = V4MoE(cfg, V4Router(cfg, cfg.mlp_layer_types[layer_id] == "hash_moe", vocab_size))
        self.attn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, vb: V4Batch, pool: KVPool) -> torch.Tensor:
        streams = self.hc_attn(streams, lambda x: self.attn(self.attn_norm(x), vb, pool))
        return self.hc_ffn(streams, lambda x: self.ffn(self.ffn_norm(x), vb.input_ids))


class V4Model(nn.Module):
    def __init__(self, config: ModelConfig, cfg: V4Config):
        super().__init__()
        self.cfg = cfg
        main, compress = V4Rotary(cfg, cfg.rope_main), V4Rotary(cfg, cfg.rope_compress)
        self.rotaries = (main, compress)
        self.embed_tokens = nn.Embedding(config.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            V4DecoderLayer(cfg, i, main if t == SLIDING else compress, config.vocab_size)
            for i, t in enumerate(cfg.layer_types))
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)
        self.query_block = 256
        """Most prefill queries of one sequence attended together (bounds the (Q, H, keys) score tensor)."""
        self.ratios = cfg.ratios()

    def prepare_batch(self, batch: ForwardBatch) -> V4Batch:
        """The step's window, compressor and attention-group indices, shared by every layer (in the compact
        pool, after the pool has given the step's tokens their recent rows)."""
        pool, ratios = batch.pool, self.cfg.ratios()
        if not isinstance(pool, V4Pool):
            return build_v4_batch(batch, self.cfg.sliding_window, ratios, self.query_block)
        return build_v4_batch(batch, self.cfg.sliding_window, ratios, self.query_block, pool.prepare(batch),
                              {m: pool.entry_divisor(m) for m in ratios})

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        vb: V4Batch = batch.model_meta.for_step()  # DeepseekV4ForCausalLM.prepare_batch / prepare_graph_batch
        x = self.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # (T, N, D)
        with shared_tables(self.rotaries):
            for layer in self.layers:
                streams = layer(streams, vb, batch.pool)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    packed_modules = [("attn.wqkv_a", "attn.wq_a", "wq_a"), ("attn.wqkv_a", "attn.wkv", "wkv"),
                      ("compressor.wkvgate", "compressor.wkv", "wkv"), ("compressor.wkvgate", "compressor.wgate", "wgate"),
                      ("shared_experts.w13", "shared_experts.w1", "w1"), ("shared_experts.w13", "shared_experts.w3", "w3")]
    """Products merged at build: the attention's wq_a and wkv (one input, x), each compressor's wkv and wgate, the
    shared expert's w1 and w3."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = self._build_model(config)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        env = get_env()
        self.is_compact_pool = env.v4_kv_layout == "compact"
        self.is_graph_enabled = env.v4_cuda_graphs

    def _build_model(self, config: ModelConfig) -> nn.Module:
        """The decoder stack (a family built on this class returns its own)."""
        return V4Model(config, V4Config.from_model_config(config))

    @property
    def supports_cuda_graphs(self) -> bool:
        """Decode steps of fixed shape (graph_batch.py) need the compact pool's padding rows; on unless
        DEEPINFER_V4_CUDA_GRAPHS=0 (env.py)."""
        return self.is_compact_pool and self.is_graph_enabled

    @staticmethod
    def kv_layout(config: ModelConfig) -> KVLayout:
        """The compact pool (models/deepseek_v4/cache.py) unless DEEPINFER_V4_KV_LAYOUT=per_token."""
        cfg, env = V4Config.from_model_config(config), get_env()
        if env.v4_kv_layout == "per_token":
            dims = tuple(PoolColumns.for_layer(cfg, t).width for t in cfg.layer_types)
            return KVLayout(config.num_layers, (1, max(dims)), None, cfg.head_dim, layer_dims=dims)
        if env.v4_kv_layout != "compact":
            raise ValueError(f"DEEPINFER_V4_KV_LAYOUT must be 'compact' or 'per_token', got {env.v4_kv_layout!r}")
        if env.v4_checkpoint_tokens < 1 or not 0 < env.v4_recent_fraction <= 1:
            raise ValueError("DEEPINFER_V4_CHECKPOINT_TOKENS must be >= 1 and DEEPINFER_V4_RECENT_FRACTION in (0, 1]")
        cols = [PoolColumns.compact(cfg, t) for t in cfg.layer_types]
        recent = tuple(c.recent_width for c in cols)
        return V4KVLayout(config.num_layers, (1, max(recent)), None, cfg.head_dim, layer_dims=recent,
                          ratios=tuple(cfg.ratio(t) for t in cfg.layer_types),
                          entry_dims=tuple(c.entry_width for c in cols), recent_tokens=recent_tokens(cfg),
                          checkpoint_tokens=env.v4_checkpoint_tokens, recent_fraction=env.v4_recent_fraction,
                          release_margin=env.v4_release_margin,
                          swa_dim=cfg.head_dim,
                          idx_entry_dims=tuple(c.idx_entry.stop - c.idx_entry.start for c in cols))

    def prepare_batch(self, batch: ForwardBatch) -> None:
        batch.model_meta = self.model.prepare_batch(batch)

    def prepare_graph_batch(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        batch.model_meta = self.static_decode(batch, seq_lens)

    def static_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> StaticDecode:
        if not isinstance(batch.pool, V4Pool):
            raise ValueError("fixed-shape DeepSeek-V4 decode steps need the compact KV pool")
        return StaticDecode(batch.input_ids, batch.positions, seq_lens, batch.pages.table, batch.pages.rows,
                            batch.pool, self.model.cfg.sliding_window, self.model.ratios)

    def prepare_graph_step(self, pool, reqs: list, positions: list[int]) -> None:
        pool.prepare_decode([r.pages for r in reqs], positions)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def _apply(self, fn, recurse=True):
        # Follow device moves but not dtype casts for the fp32 parameters (cf. layers/moe.py Router).
        fp32 = {n: p.data for n, p in self.named_parameters() if _FP32.search(n) and p.dtype == torch.float32}
        super()._apply(fn, recurse)
        params = dict(self.named_parameters())
        for name, data in fp32.items():
            params[name].data = data.to(params[name].device)
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_method.apply(self.head, hidden).float()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.head.weight = self.model.embed_tokens.weight

    def _is_tied(self, name: str) -> bool:
        return self.config.tie_word_embeddings and name == "head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        num_layers = self.config.num_layers

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = from_release_name(name)
                m = _LAYER.match(name)
                if name.startswith("mtp.") or (m is not None and int(m[1]) >= num_layers):
                    continue  # multi-token-prediction layers are not run
                for pattern, repl in _RENAMES:
                    name = pattern.sub(repl, name)
                yield name, tensor

        super().load_weights(fuse_expert_weights(renamed(), self.config.n_routed_experts))

    @torch.no_grad()
    def init_dummy(self, seed: int) -> None:
        super().init_dummy(seed)
        self.init_dummy_tables(seed)

    @torch.no_grad()
    def init_dummy_tables(self, seed: int) -> None:
        """The integer parameters of load_format='dummy' (also called by EP workers' sharded dummy init)."""
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        for name, p in self.named_parameters():
            if name.endswith("tid2eid"):  # a random hash: each token id gets top_k distinct experts
                e = self.config.n_routed_experts
                p.copy_(torch.rand(p.shape[0], e, generator=gen).argsort(dim=-1)[:, : p.shape[1]])
