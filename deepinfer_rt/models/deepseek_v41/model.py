"""DeepSeek-V4.1 (V4.1-Flash layout) over the engine's paged KV pool: per-layer sliding window plus the ratio-1 / 2
long-range path with cross-layer KV and index sharing (attention.py), shifted or V4 hyper-connections, Engram
(engram.py), YOCO shared hidden, and V4's sqrtsoftplus MoE (every layer learned-routed, clamped SwiGLU, one shared
expert).

Reused from DeepSeek-V4 where the math is the same: RMSNorm, RoPE tables (YaRN through transformers), the
hyper-connection mixes (Sinkhorn) and head, the router / experts / shared expert, the attention-group and
compression-window indices (deepseek_v4/batch.py), weight renames and fp32 parameter handling.

The DSpark drafter's mtp.* weights are skipped here: speculative="dspark" loads them (speculative/dspark.py) and
hooks its feature capture onto the target layers (`V41DecoderLayer.capture`).

Release-format weights (FP8 e4m3 with e8m0 32 x 32 blocks, MXFP4 routed experts, FP8 Engram tables) load
through the layers' methods (layers/quant_formats.py). Engram tables can stay in host memory (env.py
DEEPINFER_V41_ENGRAM_HOST; engram.py Engram.is_host_table).

The image-token router correction bias (`layers.N.ffn.gate.bias_vl`, fp32 (n_routed_experts,), in multimodal release
checkpoints) is loaded when present and kept in fp32 (`V41MoE`), but it never acts here: it replaces `gate.bias` in
the expert choice of image-span rows only (vLLM's V4.1 MoE: rows whose input id is the image token; TensorRT-LLM's
router: an image mask), and this text-only engine refuses prompts holding the image token. The drafter's stages do
not use it (vLLM passes none to them): a drafter checkpoint carrying one is refused by name.

CUDA graphs: decode steps of fixed shape (V41StaticDecode over deepseek_v4/graph_batch.py, Engram rows hashed on the
device), with the compact pool, device-resident Engram tables and no DSpark drafter attached.

Not covered by this slice: the vision tower (prompts holding the image token are refused).

Batch-invariant mode: every layer's numerics come from its method object (deepseek_v41/methods.py, V4's
deepseek_v4/methods.py), chosen at build; the forward here holds no mode test.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
from deepinfer_rt.env import get_env
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.models.deepseek_v4.batch import build_v4_batch
from deepinfer_rt.models.deepseek_v4.cache import V4KVLayout, V4Pool
from deepinfer_rt.models.deepseek_v4.common import V4RMSNorm, V4Rotary, shared_tables
from deepinfer_rt.models.deepseek_v4.graph_batch import StaticDecode
from deepinfer_rt.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead
from deepinfer_rt.models.deepseek_v4.methods import v4_method
from deepinfer_rt.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer_rt.models.deepseek_v4.moe import V4MoE, V4Router
from deepinfer_rt.models.deepseek_v41.attention import V41Attention, V41Step, pool_width, recent_width, v41_layer_kv
from deepinfer_rt.models.deepseek_v41.config import V41Config, V41Layer
from deepinfer_rt.models.deepseek_v41.engram import DeviceEngramHashing, Engram, EngramHashing, tokenizer_vocabulary
from deepinfer_rt.models.release_names import from_release_name

_DIGITS = 3  # a compressed id kept as base-256 digits: exact in bf16 / fp16 / fp32 pools
_IMAGE_BIAS = re.compile(r"^model\.layers\.(\d+)\.ffn\.gate\.bias_vl$")


def check_truncation(cfg: V41Config) -> None:
    """ValueError unless YOCO prefill truncation can run on this layer plan."""
    if cfg.yoco_capture_layer is None:
        raise ValueError("YOCO prefill truncation: the model has no YOCO consumer layers")
    for spec in cfg.layers[cfg.n_prefill_layer:]:
        for name, source in (("index", spec.index_source), ("candidate", spec.candidate_source)):
            if source is not None and source < cfg.n_prefill_layer:
                raise ValueError(f"YOCO prefill truncation: consumer layer {spec.layer_id} reuses the {name} "
                                 f"selection of layer {source}, before the consumers")


@dataclass
class V41StaticDecode:
    """A fixed-size decode step (deepseek_v4/graph_batch.py) plus V4.1's Engram rows, computed on the device: each
    row's n-gram history from the compressed ids kept in the recent rows (pad before position 0)."""

    v4: StaticDecode
    hashing: DeviceEngramHashing | None
    layer_ids: tuple[int, ...]
    id_buf: torch.Tensor | None
    """The first Engram layer's recent rows (their last _DIGITS columns hold the tokens' compressed ids)."""

    def for_step(self) -> V41Step:
        vb, ids = self.v4.for_step(), self.v4.input_ids
        if self.hashing is None:
            return V41Step(vb, {}, ids)
        h, p = self.hashing, self.v4.positions
        compressed = h.lookup[ids]
        back = torch.arange(1, h.max_ngram, device=p.device)
        earlier = p[:, None] - back  # (B, n - 1): column k - 1 = k positions back
        ok = earlier >= 0
        slots = self.v4.recent_slots(earlier.clamp(min=0), ok, 0)
        digits = self.id_buf[slots, -_DIGITS:].float().round().long()
        place = 256 ** torch.arange(_DIGITS, device=p.device)
        history = torch.cat([compressed[:, None], torch.where(ok, (digits * place).sum(-1), h.pad)], dim=1)
        return V41Step(vb, {layer: h.rows(layer, history) for layer in self.layer_ids}, compressed)


class V41MoE(V4MoE):
    """Router (`gate`: weight, text correction bias `bias`, and once loaded the image-token bias `bias_vl`, unused by
    a text-only engine: see the module docstring), routed experts, shared expert."""

    def __init__(self, cfg: V41Config):
        super().__init__(cfg, V4Router(cfg, is_hash=False, vocab_size=cfg.vocab_size), cfg.gate_temp)


class V41DecoderLayer(nn.Module):
    def __init__(self, cfg: V41Config, spec: V41Layer, rotary: V4Rotary, hashing: EngramHashing | None):
        super().__init__()
        self.spec, self.is_shifted = spec, cfg.hc_shifted
        self.is_yoco_capture = spec.layer_id == cfg.yoco_capture_layer
        self.attn = V41Attention(cfg, spec, rotary)
        self.ffn = V41MoE(cfg)
        self.attn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        self.capture = None
        """A DSpark drafter's feature hook (speculative/dspark.py FeatureCapture), set on its target layers: called
        with this layer's input streams (after Engram, before the attention pre-mix)."""
        self.engram = None
        if spec.engram_slot is not None:
            num_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            self.engram = Engram(cfg.hidden_size, cfg.hc_mult, hashing.table_rows(spec.layer_id), cfg.engram_head_dim,
                                 num_cols, cfg.rms_norm_eps, is_host_table=get_env().v41_engram_host)

    def _sublayer(self, hc: HyperConnection, streams, carried, block):
        """One mHC sublayer; shifted: the input applies the previous sublayer's pre-mix (`carried`) and this one's
        is handed on. Returns the new streams and the pre-mix to carry."""
        pre, post, comb = hc.weights(streams)
        use = carried if self.is_shifted else pre
        y = block(hc.method.hc_collapse(use, streams))
        return hc.method.hc_expand(post, y, comb, streams), pre

    def _attention(self, x: torch.Tensor, step: V41Step, pool: KVPool) -> torch.Tensor:
        h = self.attn_norm(x)
        if self.is_yoco_capture:
            step.shared_hidden = h
        return self.attn(h, step.shared_hidden if self.spec.is_yoco_consumer else h, step, pool)

    def _compacting_attention(self, streams, carried, step: V41Step, pool: KVPool):
        """The YOCO capture layer under prefill truncation: the shared hidden from every row, then only the kept
        rows go on (streams, carried and this sublayer's mixes)."""
        hc, keep = self.hc_attn, step.keep
        pre, post, comb = hc.weights(streams)
        use = carried if self.is_shifted else pre
        h = self.attn_norm(hc.method.hc_collapse(use, streams))
        step.shared_hidden = h
        y = self.attn(h[keep], h, step, pool)
        streams, post, comb = streams[keep], post[keep], comb[keep]
        return hc.method.hc_expand(post, y, comb, streams), pre[keep]

    def forward(self, streams, carried, step: V41Step, pool: KVPool, input_ids: torch.Tensor):
        if self.engram is not None:
            streams = self.engram(streams, step.engram_rows[self.spec.layer_id])
        if self.capture is not None:
            self.capture(self.spec.layer_id, streams)
        if self.is_yoco_capture and step.keep is not None:
            streams, carried = self._compacting_attention(streams, carried, step, pool)
            input_ids = input_ids[step.keep]
        else:
            streams, carried = self._sublayer(self.hc_attn, streams, carried, lambda x: self._attention(x, step, pool))
        streams, carried = self._sublayer(self.hc_ffn, streams, carried, lambda x: self.ffn(self.ffn_norm(x), input_ids))
        return streams, carried, input_ids


class V41Model(nn.Module):
    def __init__(self, config: ModelConfig, cfg: V41Config):
        super().__init__()
        self.cfg = cfg
        self.hashing = None
        if cfg.engram_layer_ids:
            tok_dir = config.raw.get("_tokenizer_dir")
            if tok_dir is None:
                raise ValueError("Engram layers need the model folder's tokenizer (compressed vocabulary)")
            lookup, num_compressed = tokenizer_vocabulary(tok_dir, cfg.vocab_size)
            self.hashing = EngramHashing(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                         cfg.engram_vocab_size, lookup, num_compressed, cfg.engram_pad_token_id)
            for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
                if self.hashing.table_rows(layer) != rows:
                    raise ValueError(f"engram_num_embeddings: layer {layer} declares {rows} rows, the prime tables "
                                     f"derived from the config hold {self.hashing.table_rows(layer)}")
        rotary = {"main": V4Rotary(cfg, cfg.rope_main), "compress": V4Rotary(cfg, cfg.rope_compress)}
        self.rotaries = tuple(rotary.values())
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V41DecoderLayer(cfg, s, rotary[s.rope], self.hashing) for s in cfg.layers)
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = None if cfg.hc_shifted else HyperHead(cfg)
        self.method = v4_method(current_kernel_config())
        self.ratios = tuple(sorted({s.ratio for s in cfg.layers} - {0}))
        self.query_block = 256
        """Most prefill queries of one sequence attended together (bounds the (Q, H, keys) score tensor)."""
        self.truncate_prefill = get_env().v41_yoco_truncation
        """YOCO prefill truncation (env.py DEEPINFER_V41_YOCO_TRUNCATION): consumer layers compute only the last
        sliding window of each prefill chunk's queries. Exact for those rows, since every consumer's KV comes from
        the shared hidden of all rows; needs every consumer's index and candidate source to be a consumer."""
        if self.truncate_prefill:
            check_truncation(cfg)

    def prepare_batch(self, batch: ForwardBatch) -> V41Step:
        pool, recent, divisors = batch.pool, None, None
        if isinstance(pool, V4Pool):  # the compact pool gives the step's tokens their recent rows first
            recent, divisors = pool.prepare(batch), {m: pool.entry_divisor(m) for m in self.ratios}
        vb = build_v4_batch(batch, self.cfg.sliding_window, self.ratios, self.query_block, recent, divisors)
        step = self._engram_step(batch, vb, batch.kv_slots if recent is None else recent)
        window = self.cfg.sliding_window
        if self.truncate_prefill and any(q > window for q in batch.q_lens):
            kept = [min(q, window) for q in batch.q_lens]
            ends = torch.tensor(batch.q_lens).cumsum(0).tolist()
            step.keep = torch.cat([torch.arange(e - k, e) for e, k in zip(ends, kept)]).to(batch.input_ids.device)
            queries = dataclasses.replace(batch, input_ids=batch.input_ids[step.keep],
                                          positions=batch.positions[step.keep], out_slots=batch.out_slots[step.keep],
                                          q_lens=kept)
            step.query_vb = build_v4_batch(queries, window, self.ratios, self.query_block, recent, divisors)
        return step

    def _engram_step(self, batch: ForwardBatch, vb, recent: list[torch.Tensor]) -> V41Step:
        if self.hashing is None:
            return V41Step(vb, {}, batch.input_ids)
        device = batch.input_ids.device
        compressed = self.hashing.lookup[batch.input_ids.cpu().numpy()]
        back = self.cfg.engram_max_ngram_size - 1
        id_layer = self.cfg.engram_layer_ids[0]
        buf = v41_layer_kv(batch.pool, self.cfg, id_layer).recent
        history, row = [], 0
        for q_len, kv_len, slots in zip(batch.q_lens, batch.kv_lens, recent):
            start = kv_len - q_len
            lo = max(0, start - back)
            digits = buf[slots[lo:start], -_DIGITS:].float().round().long().cpu().numpy()
            earlier = (digits * (256 ** np.arange(_DIGITS))).sum(axis=1)
            seq = np.concatenate([np.full(back - (start - lo), self.hashing.pad), earlier,
                                  compressed[row : row + q_len]]).astype(np.int64)
            idx = np.arange(q_len)[:, None] + back - np.arange(back + 1)[None, :]  # column k = k tokens back
            history.append(seq[idx])
            row += q_len
        hist = np.concatenate(history)
        rows = {layer: torch.from_numpy(self.hashing.rows(layer, hist)).to(device) for layer in self.cfg.engram_layer_ids}
        return V41Step(vb, rows, torch.from_numpy(compressed).to(device))

    def static_decode(self, v4: StaticDecode) -> V41StaticDecode:
        if self.hashing is None:
            return V41StaticDecode(v4, None, (), None)
        buf = v41_layer_kv(v4.pool, self.cfg, self.cfg.engram_layer_ids[0]).recent
        return V41StaticDecode(v4, self.hashing.on_device(buf.device), self.cfg.engram_layer_ids, buf)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        step: V41Step = batch.model_meta.for_step()  # prepare_batch / prepare_graph_batch
        pool = batch.pool
        if self.hashing is not None:  # keep the tokens' compressed ids for later steps' n-gram histories
            buf = v41_layer_kv(pool, self.cfg, self.cfg.engram_layer_ids[0]).recent
            ids = step.compressed_ids
            digits = torch.stack([(ids // 256 ** k) % 256 for k in range(_DIGITS)], dim=1)
            buf[step.vb.out_slots, -_DIGITS:] = digits.to(buf.dtype)
        x = self.embed_tokens(batch.input_ids)
        n = self.cfg.hc_mult
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()  # (T, N, D)
        carried = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        carried[:, 0] = 1.0  # the first shifted sublayer reads stream 0
        input_ids = batch.input_ids
        with shared_tables(self.rotaries):
            for layer in self.layers:
                streams, carried, input_ids = layer(streams, carried, step, pool, input_ids)
        if self.hc_head is not None:
            hidden = self.norm(self.hc_head(streams))
        else:
            collapsed = self.method.middle_sum(carried.unsqueeze(-1) * streams.float(), dim=1)
            hidden = self.norm(collapsed.to(streams.dtype))
        if step.keep is None:
            return hidden
        # Rows the consumer layers skipped have no output: NaN, so that no reader mistakes them for values.
        full = hidden.new_full((x.shape[0], hidden.shape[1]), float("nan"))
        full[step.keep] = hidden
        return full


class DeepseekV41ForCausalLM(DeepseekV4ForCausalLM):
    """Shares V4's head, fp32 parameter handling, weight renames, expert fusion and dummy init."""

    packed_modules = [entry for entry in DeepseekV4ForCausalLM.packed_modules if entry[0].startswith("shared_experts")]
    """The shared expert's w1 / w3 only: V4.1's wq_a and wkv read different inputs (YOCO consumers)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.supports_overlap = self.model.hashing is None  # Engram hashes the step's token ids on the host

    def _build_model(self, config: ModelConfig) -> nn.Module:
        self.v41 = V41Config.from_raw(_config_dict(config))
        return V41Model(config, self.v41)

    @property
    def supports_cuda_graphs(self) -> bool:
        """Fixed-shape decode steps (V41StaticDecode) need the compact pool; Engram tables in host memory gather
        on the host, and a DSpark drafter's feature hook runs in Python, neither of which a graph replays. Off
        under DEEPINFER_V4_CUDA_GRAPHS=0, as for V4."""
        layers = self.model.layers
        return (self.is_compact_pool and self.is_graph_enabled and not any(l.engram is not None and l.engram.is_host_table for l in layers)
                and all(l.capture is None for l in layers))

    def prepare_graph_batch(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        batch.model_meta = self.model.static_decode(self.static_decode(batch, seq_lens))

    @staticmethod
    def kv_layout(config: ModelConfig) -> KVLayout:
        """The compact pool (entries only on KV sources) unless DEEPINFER_V4_KV_LAYOUT=per_token; kv_cache_dtype
        'fp8_e4m3' (compact pool only) keeps the sliding keys, entries and index keys as e4m3 rows + fp32 scales,
        'fp4_e2m1' the sliding keys so and the entries and index keys as MXFP4 rows (e2m1 + e8m0 per 32)."""
        cfg, env = V41Config.from_raw(_config_dict(config)), get_env()
        if env.v4_kv_layout == "per_token":
            dims = tuple(pool_width(cfg, s) for s in cfg.layers)
            return KVLayout(config.num_layers, (1, max(dims)), None, cfg.head_dim, layer_dims=dims)
        if env.v4_kv_layout != "compact":
            raise ValueError(f"DEEPINFER_V4_KV_LAYOUT must be 'compact' or 'per_token', got {env.v4_kv_layout!r}")
        recent = tuple(recent_width(cfg, s) for s in cfg.layers)
        entries = tuple(cfg.head_dim + cfg.index_head_dim if s.is_kv_source else 0 for s in cfg.layers)
        # The window's W - 1, a ratio-2 window's other token, an Engram n-gram's earlier tokens.
        need = max(cfg.sliding_window - 1, 1, cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0)
        return V4KVLayout(config.num_layers, (1, max(recent)), None, cfg.head_dim, layer_dims=recent,
                          ratios=tuple(s.ratio if s.is_kv_source else 0 for s in cfg.layers), entry_dims=entries,
                          recent_tokens=need, checkpoint_tokens=env.v4_checkpoint_tokens,
                          recent_fraction=env.v4_recent_fraction,
                          release_margin=env.v4_release_margin, swa_dim=cfg.head_dim, supports_fp4=True,
                          idx_entry_dims=tuple(cfg.index_head_dim if e else 0 for e in entries))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def hf_names() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = from_release_name(name)  # embed / norm / hc_head_* / layers.* / `.scale`
                if not name.startswith(("model.", "head.", "mtp.")):  # the rest of the release's names
                    name = "model." + name
                m = _IMAGE_BIAS.match(name)
                if m is not None and int(m[1]) < len(self.model.layers):
                    self._load_image_bias(int(m[1]), name, tensor)
                    continue
                yield name, tensor

        super().load_weights(hf_names())

    @torch.no_grad()
    def _load_image_bias(self, layer: int, name: str, tensor: torch.Tensor) -> None:
        """The optional image-token correction bias, registered on the layer's router as it is read."""
        gate = self.model.layers[layer].ffn.gate
        want = (self.v41.n_routed_experts,)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {want}")
        device = gate.weight.device
        gate.bias_vl = nn.Parameter(tensor.to(device=device, dtype=torch.float32), requires_grad=False)

    def _apply(self, fn, recurse=True):
        # The image-token bias stays fp32 like the text one (deepseek_v4/model.py _FP32 names `gate.bias`, not this).
        kept = {n: p.data for n, p in self.named_parameters() if n.endswith(".gate.bias_vl")}
        super()._apply(fn, recurse)
        params = dict(self.named_parameters())
        for name, data in kept.items():
            params[name].data = data.to(params[name].device)
        return self


def _config_dict(config: ModelConfig) -> dict:
    return {k: v for k, v in config.raw.items() if k != "_tokenizer_dir"}
