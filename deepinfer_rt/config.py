"""Frozen configuration, one dataclass per layer of the system.

`ModelConfig.from_hf` normalises a Hugging Face config once; model and kernel code read only these fields.
Runtime results (pool size actually allocated, ...) are returned by the objects that compute them, never
written back here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def _get(hf: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization (HF `quantization_config`), normalised and checked once.

    Formats read (layers/quant_formats.py describes the layouts by role):
      v3-fp8  DeepSeek-V3/R1/V3.1: linear weights float8 e4m3 with a float32 `weight_scale_inv` per
              weight_block_size block (dequantized weight = fp8 value x its block's scale);
      v4      DeepSeek-V4 / V4-Flash: dense/attention weights e4m3 with e8m0 (`scale_fmt: ue8m0`) 128 x 128
              block scales, routed experts MXFP4 (`expert_dtype: fp4`);
      v41     DeepSeek-V4.1: the same with 32 x 32 dense blocks (and FP8 Engram tables, per-32 e8m0 scales).
    Embeddings, LM head, norms and the MoE router stay in 16/32-bit.
    """
    method: str = "fp8"
    """HF `quant_method`: 'fp8' (block-scaled e4m3)."""
    weight_block_size: tuple[int, int] = (128, 128)
    """(rows, columns) of a dense weight covered by one scale; activations are quantized per token in groups of
    the column block."""
    scale_fmt: str = "float32"
    """'float32' (any float scale) or 'ue8m0' (powers of two, stored as e8m0 bytes or float32)."""
    expert_dtype: str = "fp8"
    """Routed experts: 'fp8' (the dense layout) or 'fp4' (MXFP4: e2m1 pairs in int8, e8m0 per 32 along K)."""

    METHODS = ("fp8",)
    FORMATS = ("e4m3",)
    SCALE_FMTS = ("float32", "ue8m0")
    EXPERT_DTYPES = ("fp8", "fp4")

    @property
    def format(self) -> str:
        """'v3-fp8', 'v4' or 'v41' (what scripts/quantize_checkpoint.py --format names), else 'fp8-ue8m0'."""
        if self.scale_fmt == "float32":
            return "v3-fp8"
        if self.expert_dtype == "fp4":
            return {(128, 128): "v4", (32, 32): "v41"}.get(self.weight_block_size, "fp8-ue8m0")
        return "fp8-ue8m0"

    @classmethod
    def from_hf(cls, hf: Any, expert_dtype: str | None = None) -> "QuantConfig | None":
        """None for an unquantized checkpoint; ValueError naming the field for what we do not read.
        `expert_dtype`: the config's top-level field of that name (V4 ships it there, V4.1 in hf)."""
        if hf is None:
            return None
        q = hf if isinstance(hf, dict) else (hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)))
        method = q.get("quant_method")
        if method not in cls.METHODS:
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported (known: {cls.METHODS})")
        fmt = q.get("fmt", "e4m3")
        if fmt not in cls.FORMATS:
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (known: {cls.FORMATS})")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {q['activation_scheme']!r} is not supported "
                             "(known: ('dynamic',))")
        scale_fmt = {None: "float32", "fp32": "float32", "float": "float32"}.get(q.get("scale_fmt"), q.get("scale_fmt"))
        if scale_fmt not in cls.SCALE_FMTS:
            raise ValueError(f"quantization_config.scale_fmt {q['scale_fmt']!r} is not supported "
                             f"(known: {cls.SCALE_FMTS})")
        experts = q.get("expert_dtype") or expert_dtype or "fp8"
        if experts not in cls.EXPERT_DTYPES:
            raise ValueError(f"quantization_config.expert_dtype {experts!r} is not supported "
                             f"(known: {cls.EXPERT_DTYPES})")
        block = q.get("weight_block_size")
        if block is None or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
        return cls(method, (block[0], block[1]), scale_fmt, experts)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    """HF `architectures[0]`, the registry key."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """HF rope parameters beyond theta (type, factor, yarn betas, mscale...), None for plain RoPE."""
    rope_interleave: bool = False
    # --- MLA (DeepSeek-V2/V3); zero when the model uses per-head GQA attention ---
    q_lora_rank: int = 0
    """0 means no query low-rank projection (q_proj directly)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # --- MoE; n_routed_experts == 0 means a dense model ---
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    """'softmax' (DeepSeek-V2) or 'sigmoid' (DeepSeek-V3, with the correction bias)."""
    topk_method: str = "greedy"
    """'greedy', 'group_limited_greedy' (V2) or 'noaux_tc' (V3)."""
    norm_topk_prob: bool = False
    quantization: QuantConfig | None = None
    """How the checkpoint stores its weights (HF quantization_config); None for 16/32-bit weights."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    """The HF config as a dict, for model families whose extra fields are read by their own module."""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        arch = (_get(hf, "architectures") or ["LlamaForCausalLM"])[0]
        eos = _get(hf, "eos_token_id", [])
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        num_heads = hf.num_attention_heads
        rope = dict(_get(hf, "rope_parameters", None) or _get(hf, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", _get(hf, "rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) in ("default", None):
            rope = {}
        is_deepseek = "Deepseek" in arch
        is_v3 = arch.startswith("DeepseekV3")
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=_get(hf, "num_key_value_heads", num_heads),
            head_dim=_get(hf, "head_dim", hf.hidden_size // num_heads),
            intermediate_size=_get(hf, "intermediate_size", 0),
            rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
            max_position=_get(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
            eos_token_ids=tuple(e for e in eos_ids if e is not None),
            bos_token_id=_get(hf, "bos_token_id", None),
            hidden_act=_get(hf, "hidden_act", "silu"),
            attention_bias=bool(_get(hf, "attention_bias", False)),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            rope_interleave=bool(_get(hf, "rope_interleave", is_deepseek)),
            q_lora_rank=_get(hf, "q_lora_rank", 0),
            kv_lora_rank=_get(hf, "kv_lora_rank", 0),
            qk_nope_head_dim=_get(hf, "qk_nope_head_dim", 0),
            qk_rope_head_dim=_get(hf, "qk_rope_head_dim", 0),
            v_head_dim=_get(hf, "v_head_dim", 0),
            n_routed_experts=_get(hf, "n_routed_experts", 0),
            num_experts_per_tok=_get(hf, "num_experts_per_tok", 0),
            n_shared_experts=_get(hf, "n_shared_experts", 0),
            moe_intermediate_size=_get(hf, "moe_intermediate_size", 0),
            first_k_dense_replace=_get(hf, "first_k_dense_replace", 0),
            moe_layer_freq=_get(hf, "moe_layer_freq", 1),
            n_group=_get(hf, "n_group", 1),
            topk_group=_get(hf, "topk_group", 1),
            routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
            scoring_func=_get(hf, "scoring_func", "sigmoid" if is_v3 else "softmax"),
            topk_method=_get(hf, "topk_method", "noaux_tc" if is_v3 else "greedy"),
            norm_topk_prob=bool(_get(hf, "norm_topk_prob", False)),
            quantization=QuantConfig.from_hf(_get(hf, "quantization_config", None), _get(hf, "expert_dtype", None)),
            raw=hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)),
        )


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 1
    """Tokens per KV page; allocation and prefix-cache matches are aligned to pages."""
    kv_cache_tokens: int | None = None
    """Pool size in tokens; None sizes it from the memory budget."""
    enable_prefix_cache: bool = True
    kv_cache_dtype: str = "auto"
    """'auto': KV rows in the model dtype; 'fp8_e4m3': float8_e4m3fn rows with one float32 scale per (token, KV
    head), about half the bytes per token (cache/kv_pool.py); the compact DeepSeek-V4 pool keeps its sliding keys
    and entries in FP8 with a scale per row (models/deepseek_v4/cache.py); 'fp4_e2m1' (DeepSeek-V4.1 only): its
    entries and index keys as MXFP4 (e2m1 + an e8m0 scale per 32), its sliding keys as under 'fp8_e4m3'."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    chunked_prefill_tokens: int = 2048
    """Token budget of one step (decode tokens + prefill chunks)."""
    schedule_policy: str = "lpm"
    """'lpm' (longest cached prefix first; FCFS when the queue is long) or 'fcfs'."""
    decode_reserve_tokens: int = 16
    """KV slots a decoding request takes ahead of need, so its KV stays in contiguous runs."""
    inflight_prefix_min_tokens: int = 32
    """A waiting request sharing at least this many uncached tokens with a prefill in flight waits a step
    for it, then reuses those tokens from the prefix cache."""
    lpm_fallback_queue_len: int = 128
    """Above this many waiting requests, 'lpm' falls back to FCFS so nothing starves."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    load_format: str
    seed: int
    batch_invariant: bool
    ep_size: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    quantization: str | None = None
    """Engine(quantization=): 'fp8' quantizes 16/32-bit weights to block-scaled e4m3 at load (a checkpoint
    already in FP8 needs nothing); 'int8' / 'q4_1' weight-only on CPU (layers/int8.py, layers/q4.py); None keeps
    what the checkpoint stores."""
