"""DeepSeek-V4.1 configuration: the raw checkpoint config parsed once, and the per-layer descriptor.

Three spellings of the same model are accepted:
  * the HF composite `model_type: deepseek_v41` with the language model under `text_config`
    (`deepseek_v41_text`) and a `vision_config` (the engine is text-only: image inputs are refused per request);
  * a flat `deepseek_v41_text` config;
  * the release's `inference/config.json`, with the reference code's names (`dim`, `n_layers`, ...).

V4.1's `compress_ratios` is a per-layer pooling factor over contiguous bands, read raw and never normalised:
  0  sliding window only, plain RoPE (`rope_theta`);
  1  plus a long-range path over *every* past position, unpooled;
  2  plus a long-range path over softmax-gated 2:1 pooled entries.
Every nonzero ratio uses YaRN RoPE with `compress_rope_theta`. Only `kv_source_layer_ids` own a compressor and a
compressed cache; every other long-range layer reads the latest source's. Only `index_source_layer_ids` score
indexer queries; the other long-range layers reuse the latest index source's top-k. The candidate source layer
publishes a set of token blocks (block-max of its indexer scores) that later index sources score inside.

`V41Config.layers` is the one per-layer descriptor; every later decision reads it (never the raw ratio).
Field names follow TensorRT-LLM's `tensorrt_llm/_torch/configs/deepseek_v41.py` (its defaults are the released
V4.1-Flash values); the release names are mapped in `_RELEASE_NAMES`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from deepinfer_rt.models.deepseek_v4.common import parse_rope

ARCHITECTURE = "DeepseekV41ForCausalLM"

# Generic keys PretrainedConfig writes that say nothing about the network.
_GENERIC = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
            "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
            "attention_bias", "hidden_act", "num_key_value_heads", "keys_to_ignore_at_inference", "_name_or_path",
            "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings", "auto_map",
            "max_position_embeddings", "n_shared_experts", "topk_method", "norm_topk_prob", "rope_scaling",
            "rope_parameters", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
            "problem_type", "tokenizer_class", "task_specific_params", "architectures"}

# Release `inference/config.json` name -> HF text-config name.
_RELEASE_NAMES = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim", "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups", "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func", "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit", "window_size": "sliding_window", "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings", "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids", "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings", "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size", "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim", "engram_pad_token_id": "engram_pad_token_id",
    "candidate_source_layer": "candidate_source_layer_id", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "hc_shifted": "hc_shifted", "n_prefill_layer": "n_prefill_layer",
    "gate_temp": "gate_temp", "n_mtp_layers": "num_nextn_predict_layers",
    "dspark_block_size": "dspark_block_size", "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids", "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts", "dspark_num_experts_per_tok": "dspark_num_experts_per_tok",
}
_RELEASE_ROPE = {"rope_factor": "factor", "original_seq_len": "original_max_position_embeddings",
                 "beta_fast": "beta_fast", "beta_slow": "beta_slow"}


@dataclass(frozen=True)
class V41Layer:
    """One decoder layer's role, from the raw config (TensorRT-LLM's DeepseekV41LayerDescriptor, trimmed)."""

    layer_id: int
    ratio: int
    """The raw compress_ratios entry: 0, 1 or 2."""
    rope: str
    """'main' (plain rope_theta) for ratio 0, 'compress' (YaRN, compress_rope_theta) otherwise."""
    kv_source: int | None
    """Layer whose compressor and compressed cache this layer reads (itself on a KV source); None = sliding only."""
    index_source: int | None
    """Layer whose indexer top-k this layer attends with (itself on an index source); None = sliding only."""
    candidate_source: int | None
    """The candidate-source layer whose block set restricts this index source's scores; None = unrestricted."""
    is_candidate_source: bool
    engram_slot: int | None
    """Position in engram_layer_ids (which table) when the layer runs Engram, else None."""
    is_yoco_consumer: bool
    """Takes its KV from the shared hidden (the first consumer's attention-norm output)."""

    @property
    def has_long_range(self) -> bool:
        return self.ratio != 0  # ratio 1 is "every position", not "no compression"

    @property
    def is_kv_source(self) -> bool:
        return self.kv_source == self.layer_id

    @property
    def is_index_source(self) -> bool:
        return self.index_source == self.layer_id


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    """Trailing channels of each head (and of each indexer head) that get RoPE."""
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    gate_temp: float
    swiglu_limit: float
    rms_norm_eps: float
    """Every RMSNorm and the hyper-connection mixer statistics."""
    hc_eps: float
    """Hyper-connection pre-weight and Sinkhorn epsilon (kept apart from rms_norm_eps: the release differs)."""
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_shifted: bool
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_topk_blocks: int
    candidate_block_size: int
    """Compressed entries of the candidate source per block."""
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    """Scalar start of the prime search for every n-gram order and head."""
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    n_prefill_layer: int
    """YOCO: layers [n_prefill_layer, num_layers) are consumers; == num_layers turns YOCO off. Absent from the
    config: the first ratio-1 layer."""
    num_nextn_predict_layers: int
    """DSpark draft stages in the checkpoint (`mtp.{s}.*`), run by speculative="dspark"."""
    max_position: int
    rope_main: dict
    rope_compress: dict
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_vision: bool
    image_token_id: int | None
    """The composite config's image placeholder id: a prompt holding it is refused (text-only engine)."""
    layers: tuple[V41Layer, ...]
    dspark_block_size: int = 0
    """DSpark: positions of one draft block (the last sampled token + noise placeholders); 0 = no drafter."""
    dspark_noise_token_id: int | None = None
    """DSpark: the placeholder token of block positions after the first (None = vocab_size - 1)."""
    dspark_target_layer_ids: tuple[int, ...] = ()
    """DSpark: target layers whose input (mean of the mHC streams) the drafter reads, concatenated."""
    dspark_markov_rank: int = 0
    """DSpark: rank of the Markov (bigram) logit correction and width it adds to the confidence input."""
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    """DSpark: the draft stages' own (smaller) expert bank; None = the target's."""

    # ---- parsing ----

    @classmethod
    def from_raw(cls, raw: dict) -> "V41Config":
        """Parse any of the three spellings (module docstring); ValueError naming the field for what is wrong or
        not supported."""
        raw = dict(raw)
        v41_quantization(raw)  # refuses another layout than the release's, naming the field
        raw.pop("quantization_config", None)
        model_type = raw.get("model_type")
        has_vision, image_token_id = False, None
        if model_type == "deepseek_v41":
            if "text_config" not in raw:
                raise ValueError("deepseek_v41 config has no text_config")
            has_vision = raw.get("vision_config") is not None
            outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config", "model_type")}
            unknown = set(outer) - _GENERIC - {"image_token_id", "image_token_index"}
            if unknown:
                raise ValueError(f"deepseek_v41 config: unsupported top-level fields {sorted(unknown)}")
            text = dict(raw["text_config"])
            image_token_id = outer.get("image_token_id", outer.get("image_token_index"))
            for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
                if key in outer and key not in text:
                    text[key] = outer[key]
        elif model_type in ("deepseek_v41_text", None) and "n_layers" not in raw:
            if model_type is None:
                raise ValueError("config has neither model_type deepseek_v41[_text] nor the release's names")
            text = raw
        elif "n_layers" in raw and "dim" in raw:
            text = _from_release(raw)
        else:
            raise ValueError(f"not a DeepSeek-V4.1 config (model_type {model_type!r})")
        return cls._from_text(text, has_vision, image_token_id)

    @classmethod
    def _from_text(cls, t: dict, has_vision: bool, image_token_id: int | None) -> "V41Config":
        t = dict(t)
        t.pop("model_type", None)
        known = {f.name for f in fields(cls)} | _GENERIC | {
            "num_hidden_layers", "num_attention_heads", "qk_rope_head_dim", "scoring_func", "compress_ratios",
            "compress_rope_theta", "rope_theta", "kv_source_layer_ids", "index_source_layer_ids",
            "candidate_source_layer_id", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
            "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok", "engram_compressed_vocab_size",
            "max_position_embeddings", "rms_norm_eps"}
        unknown = sorted(set(t) - known)
        if unknown:
            raise ValueError(f"DeepSeek-V4.1 text config: unsupported fields {unknown}")

        def need(name: str) -> Any:
            if t.get(name) is None:
                raise ValueError(f"DeepSeek-V4.1 config lacks {name!r}")
            return t[name]

        if t.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ValueError(f"scoring_func must be 'sqrtsoftplus' for V4.1, got {t['scoring_func']!r}")
        if t.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"topk_method must be 'noaux_tc' for V4.1, got {t['topk_method']!r}")
        if t.get("n_shared_experts", 1) != 1:
            raise ValueError(f"n_shared_experts must be 1, got {t['n_shared_experts']}")
        if t.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {t['hidden_act']!r}")
        n = int(need("num_hidden_layers"))
        ratios = [int(r) for r in need("compress_ratios")]
        num_mtp = int(t.get("num_nextn_predict_layers", 0))
        if len(ratios) not in (n, n + num_mtp):
            raise ValueError(f"compress_ratios has {len(ratios)} entries, expected num_hidden_layers ({n})"
                             f"{f' or + num_nextn_predict_layers ({n + num_mtp})' if num_mtp else ''}")
        need("qk_rope_head_dim")
        head_dim, index_head_dim = int(need("head_dim")), int(need("index_head_dim"))
        rope_dim, rope_main, rope_compress = parse_rope(t, head_dim, index_head_dim, "V4.1")
        num_heads, o_groups = int(need("num_attention_heads")), int(need("o_groups"))
        if num_heads % o_groups:
            raise ValueError(f"o_groups ({o_groups}) must divide num_attention_heads ({num_heads})")
        max_pos = int(t.get("max_position_embeddings", 1048576))
        engram_ids = tuple(int(i) for i in t.get("engram_layer_ids") or ())
        engram_sizes = tuple(int(i) for i in t.get("engram_num_embeddings") or ())
        eos = t.get("eos_token_id", [])
        eos = tuple(e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        vocab = t.get("engram_vocab_size", 16000000)
        if isinstance(vocab, (list, tuple)):
            if len(set(vocab)) != 1:
                raise ValueError(f"engram_vocab_size must be one value for every n-gram order, got {vocab}")
            vocab = vocab[0]
        # YOCO starts at the first ratio-1 layer unless the config says otherwise (V4.1-Flash: layer 20); a config
        # without ratio-1 layers has no consumers.
        n_prefill = int(t["n_prefill_layer"]) if t.get("n_prefill_layer") is not None else \
            next((i for i, r in enumerate(ratios[:n]) if r == 1), n)
        layers = build_layers(
            ratios[:n], kv_sources=need("kv_source_layer_ids") if any(ratios[:n]) else (),
            index_sources=need("index_source_layer_ids") if any(ratios[:n]) else (),
            candidate_source=t.get("candidate_source_layer_id"), engram_layer_ids=engram_ids,
            n_prefill_layer=n_prefill)
        cfg = cls(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")), num_layers=n,
            num_heads=num_heads, head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(need("q_lora_rank")),
            o_groups=o_groups, o_lora_rank=int(need("o_lora_rank")),
            moe_intermediate_size=int(need("moe_intermediate_size")), n_routed_experts=int(need("n_routed_experts")),
            n_shared_experts=1, num_experts_per_tok=int(need("num_experts_per_tok")),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.5)), gate_temp=float(t.get("gate_temp", 1.0)),
            swiglu_limit=float(t.get("swiglu_limit", 10.0)), rms_norm_eps=float(t.get("rms_norm_eps", 1e-20)),
            hc_eps=float(t.get("hc_eps", 1e-6)), hc_mult=int(t.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)), hc_shifted=bool(t.get("hc_shifted", True)),
            sliding_window=int(need("sliding_window")), index_n_heads=int(need("index_n_heads")),
            index_head_dim=index_head_dim, index_topk=int(need("index_topk")),
            candidate_topk_blocks=int(t.get("candidate_topk_blocks", 2048)),
            candidate_block_size=int(t.get("candidate_block_size", 8)), engram_layer_ids=engram_ids,
            engram_num_embeddings=engram_sizes, engram_max_ngram_size=int(t.get("engram_max_ngram_size", 4)),
            engram_vocab_size=int(vocab), engram_n_heads=int(t.get("engram_n_heads", 8)),
            engram_head_dim=int(t.get("engram_head_dim", 256)), engram_pad_token_id=int(t.get("engram_pad_token_id", 2)),
            n_prefill_layer=n_prefill, num_nextn_predict_layers=num_mtp, max_position=max_pos, rope_main=rope_main,
            rope_compress=rope_compress, tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            eos_token_ids=eos, bos_token_id=t.get("bos_token_id"), has_vision=has_vision,
            image_token_id=None if image_token_id is None else int(image_token_id), layers=layers,
            **_dspark_fields(t, n))
        cfg._check_engram()
        return cfg

    def _check_engram(self) -> None:
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries but "
                             f"engram_layer_ids has {len(self.engram_layer_ids)}")
        if self.engram_layer_ids and self.engram_max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {self.engram_max_ngram_size}")
        if self.engram_layer_ids and self.engram_vocab_size < 2:
            raise ValueError(f"engram_vocab_size must be >= 2, got {self.engram_vocab_size}")

    def check_prompt(self, token_ids) -> None:
        """ValueError for a prompt this text-only engine cannot serve (an image placeholder in it)."""
        if self.image_token_id is not None and self.image_token_id in token_ids:
            raise ValueError(f"prompt holds the image token id {self.image_token_id}: DeepSeek-V4.1 runs text-only "
                             "here (image inputs are not supported)")

    scoring_func = "sqrtsoftplus"
    """V4.1 routes every layer by sqrt(softplus) scores (read by the shared V4 router)."""

    @property
    def yoco_capture_layer(self) -> int | None:
        """The first YOCO consumer, whose attention-norm output is the shared hidden."""
        return self.n_prefill_layer if self.n_prefill_layer < self.num_layers else None

    def hf_dict(self) -> dict:
        """The ModelConfig fields the engine reads for every model (ModelConfig.from_hf input)."""
        return dict(architectures=[ARCHITECTURE], vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                    num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads, num_key_value_heads=1,
                    head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position,
                    tie_word_embeddings=self.tie_word_embeddings, eos_token_id=list(self.eos_token_ids),
                    bos_token_id=self.bos_token_id, n_routed_experts=self.n_routed_experts,
                    num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                    n_shared_experts=1, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
                    routed_scaling_factor=self.routed_scaling_factor, qk_rope_head_dim=self.rope_dim,
                    q_lora_rank=self.q_lora_rank)


def _dspark_fields(t: dict, num_layers: int) -> dict:
    """The DSpark drafter's config fields, checked against the layer count."""
    targets = tuple(int(i) for i in t.get("dspark_target_layer_ids") or ())
    bad = [i for i in targets if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"dspark_target_layer_ids {bad} are outside the {num_layers} layers")
    opt = lambda k: None if t.get(k) is None else int(t[k])  # noqa: E731
    return dict(dspark_block_size=int(t.get("dspark_block_size") or 0), dspark_noise_token_id=opt("dspark_noise_token_id"),
                dspark_target_layer_ids=targets, dspark_markov_rank=int(t.get("dspark_markov_rank") or 0),
                dspark_n_routed_experts=opt("dspark_n_routed_experts"),
                dspark_num_experts_per_tok=opt("dspark_num_experts_per_tok"))


V41_BLOCK = (32, 32)
"""Elements of a dense / attention weight per e8m0 scale in the V4.1 release (V4's were 128 x 128)."""


def v41_quantization(raw: dict) -> dict | None:
    """The checkpoint's weight quantization as an HF `quantization_config` (ModelConfig.quantization reads it),
    None for 16/32-bit weights. The composite (or flat text) config carries `quantization_config`; the release's
    inference/config.json says `dtype: fp8`, `scale_fmt`, `expert_dtype` (its dense block is V4.1's 32 x 32).
    Only the release layout is read -- FP8 e4m3 with e8m0 (ue8m0) 32 x 32 dense blocks, MXFP4 ('fp4') or
    dense-layout ('fp8') routed experts, FP8 Engram tables per 32 columns (layers/quant_formats.py): anything
    else is a ValueError naming the field."""
    from deepinfer_rt.config import QuantConfig

    q = raw.get("quantization_config")
    if q is None and "n_layers" in raw and raw.get("dtype", "bf16") not in ("bf16", "fp32"):
        if raw["dtype"] != "fp8":
            raise ValueError(f"release config: dtype {raw['dtype']!r} is not supported (bf16, fp32 or fp8)")
        q = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": raw.get("scale_fmt", "ue8m0"),
             "weight_block_size": list(V41_BLOCK), "expert_dtype": raw.get("expert_dtype") or "fp4"}
    elif q is None and raw.get("expert_dtype") not in (None, "bf16"):
        raise ValueError(f"expert_dtype {raw['expert_dtype']!r} without quantized dense weights (dtype fp8 or a "
                         "quantization_config) is not a V4.1 release layout")
    if q is None:
        return None
    q = {"expert_dtype": "fp4", **q}  # the release's experts are MXFP4 unless the config says otherwise
    parsed = QuantConfig.from_hf(q)
    if parsed.scale_fmt != "ue8m0":
        raise ValueError(f"quantization_config.scale_fmt {q.get('scale_fmt')!r}: DeepSeek-V4.1 weights carry e8m0 "
                         "scales ('ue8m0')")
    if parsed.weight_block_size != V41_BLOCK:
        raise ValueError(f"quantization_config.weight_block_size {list(parsed.weight_block_size)}: the DeepSeek-V4.1 "
                         f"release's dense blocks are {list(V41_BLOCK)}")
    return q


def _from_release(raw: dict) -> dict:
    unknown = sorted(set(raw) - set(_RELEASE_NAMES) - set(_RELEASE_ROPE) - {"dtype", "scale_fmt", "expert_dtype"})
    if unknown:
        raise ValueError(f"release config: unsupported fields {unknown}")
    text = {_RELEASE_NAMES[k]: v for k, v in raw.items() if k in _RELEASE_NAMES}
    rope = {_RELEASE_ROPE[k]: raw[k] for k in _RELEASE_ROPE if k in raw}
    if rope:
        text["rope_scaling"] = {"rope_type": "yarn", **rope}
    text["model_type"] = "deepseek_v41_text"
    return text


def build_layers(ratios: list[int], kv_sources, index_sources, candidate_source: int | None,
                 engram_layer_ids: tuple[int, ...], n_prefill_layer: int) -> tuple[V41Layer, ...]:
    """The per-layer descriptor from the raw lists, with the invariants every consumer relies on checked."""
    n = len(ratios)
    kv_src, idx_src = {int(i) for i in kv_sources}, {int(i) for i in index_sources}
    for name, ids in (("kv_source_layer_ids", kv_src), ("index_source_layer_ids", idx_src),
                      ("engram_layer_ids", set(engram_layer_ids))):
        bad = sorted(i for i in ids if not 0 <= i < n)
        if bad:
            raise ValueError(f"{name} {bad} are outside the {n} layers")
    if not 0 <= n_prefill_layer <= n:
        raise ValueError(f"n_prefill_layer must be in [0, {n}], got {n_prefill_layer}")
    if candidate_source is not None and int(candidate_source) not in idx_src:
        raise ValueError(f"candidate_source_layer_id {candidate_source} must be an index source layer")
    layers, last_kv, last_idx = [], None, None
    for i, ratio in enumerate(ratios):
        if ratio not in (0, 1, 2):
            raise ValueError(f"compress_ratios[{i}] = {ratio}: V4.1 ratios are 0, 1 or 2")
        if ratio == 0 and (i in kv_src or i in idx_src):
            raise ValueError(f"layer {i} is a kv/index source but has compress ratio 0 (no long-range path)")
        last_kv = i if i in kv_src else last_kv
        last_idx = i if i in idx_src else last_idx
        kv = idx = None
        if ratio:
            if last_kv is None or last_idx is None:
                raise ValueError(f"layer {i} has a long-range path but no kv/index source at or before it")
            if ratios[last_kv] != ratio:
                raise ValueError(f"layer {i} (ratio {ratio}) would read kv source {last_kv} of ratio {ratios[last_kv]}")
            if not last_kv <= last_idx or ratios[last_idx] != ratio:
                raise ValueError(f"layer {i}: its index source {last_idx} must read the same kv source {last_kv}")
            kv, idx = last_kv, last_idx
        cand = (int(candidate_source) if candidate_source is not None and i in idx_src and i > int(candidate_source)
                and ratios[int(candidate_source)] == ratio else None)
        if candidate_source is not None and i in idx_src and i > int(candidate_source) and cand is None:
            raise ValueError(f"index source {i} follows candidate source {candidate_source} with another ratio")
        engram = engram_layer_ids.index(i) if i in engram_layer_ids else None
        if engram is not None and i >= n_prefill_layer:
            raise ValueError(f"Engram layer {i} must come before the YOCO consumers (n_prefill_layer {n_prefill_layer})")
        layers.append(V41Layer(i, ratio, "compress" if ratio else "main", kv, idx, cand,
                               candidate_source is not None and i == int(candidate_source), engram,
                               i >= n_prefill_layer))
    return tuple(layers)


def read_config_file(path: str | Path) -> dict:
    """config.json of a model folder; the release's inference/config.json when the folder has one and no
    top-level config."""
    path = Path(path)
    top = path / "config.json"
    if top.exists():
        return json.loads(top.read_text())
    release = path / "inference" / "config.json"
    if release.exists():
        return json.loads(release.read_text())
    raise ValueError(f"model folder {path} has no config.json")


def is_v41_config(raw: dict) -> bool:
    return raw.get("model_type") in ("deepseek_v41", "deepseek_v41_text") or ("n_layers" in raw and "dim" in raw
                                                                            and "compress_ratios" in raw)


class _HFView:
    """Attribute access over a dict, standing in for a PretrainedConfig in ModelConfig.from_hf."""

    def __init__(self, values: dict, raw: dict):
        self.__dict__.update(values)
        self._raw = raw

    def to_dict(self) -> dict:
        return dict(self._raw)


def v41_model_config(raw: dict, model_dir: Path | None = None):
    """The engine-wide ModelConfig of a V4.1 config; its `raw` keeps the original dict for V41Config.from_raw, plus
    `_tokenizer_dir` (the folder whose tokenizer gives Engram's compressed vocabulary). Parsing here validates the
    whole config at load time."""
    from deepinfer_rt.config import ModelConfig

    cfg = V41Config.from_raw(raw)
    kept = dict(raw, _tokenizer_dir=None if model_dir is None else str(model_dir))
    return ModelConfig.from_hf(_HFView(dict(cfg.hf_dict(), quantization_config=v41_quantization(raw)), kept))
