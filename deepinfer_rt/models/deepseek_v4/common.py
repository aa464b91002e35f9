"""DeepSeek-V4 pieces shared by its layers: the normalised config, the interleaved partial RoPE, and the
per-token columns each layer keeps in the KV pool.

Pool columns per token slot (D = head_dim, Di = index_head_dim); `c` = 2 for CSA (two overlapping series),
1 for HCA:

    sliding_attention              [ swa_k D ]
    heavily_compressed_attention   [ swa_k D | kv c*D | gate c*D | entry D ]
    compressed_sparse_attention    [ swa_k D | kv c*D | gate c*D | entry D | idx_kv 2Di | idx_gate 2Di | idx_entry Di ]

swa_k is the token's normalised, rotated key (= value). kv/gate are the compressor's raw projections of the
token, kept so a window can be compressed whenever its last token arrives, whatever chunk its earlier tokens
came in. `entry` is meaningful only in the slot of the last token of a compression window: the compressed entry
of that window, written when that token is computed. Everything is a function of the token's prefix, so a
prefix-cache hit at any position restores the exact state, and freeing a request's slots frees all of it.

That is the per-token layout (DEEPINFER_V4_KV_LAYOUT=per_token), kept as the reference. The default compact pool
(models/deepseek_v4/cache.py, PoolColumns.compact) splits each row: [entry | idx_entry] once per window in the
main pages, [swa_k | kv | gate | idx_kv | idx_gate] in recent pages held only near a sequence's end, at
checkpoints and at resume points.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.quant_formats import E2M1_MAX, MX_BLOCK
from deepinfer_rt.models.deepseek_v4.methods import v4_method

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class V4Config:
    """The DeepSeek-V4 fields of the HF config, validated once."""

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    """Trailing channels of each head (and of indexer heads) that get RoPE."""
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict
    """Layer type -> tokens per compressed entry (CSA m, HCA m')."""
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    rms_norm_eps: float
    max_position: int
    rope_main: dict
    """HF rope parameters of sliding layers ('main') and of compressed layers and their compressors
    ('compress', possibly YaRN)."""
    rope_compress: dict

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> "V4Config":
        raw = config.raw
        n = config.num_layers
        layer_types, mlp_types = tuple(raw["layer_types"]), tuple(raw["mlp_layer_types"])
        for name, types, allowed in (("layer_types", layer_types, (SLIDING, CSA, HCA)),
                                     ("mlp_layer_types", mlp_types, ("hash_moe", "moe"))):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries but num_hidden_layers is {n}")
            if set(types) - set(allowed):
                raise ValueError(f"{name} entries must be in {allowed}, got {sorted(set(types) - set(allowed))}")
        if config.num_heads % raw["o_groups"]:
            raise ValueError(f"o_groups ({raw['o_groups']}) must divide num_attention_heads ({config.num_heads})")
        if raw["scoring_func"] not in _SCORING:
            raise ValueError(f"scoring_func must be one of {_SCORING}, got {raw['scoring_func']!r}")
        rope_dim, rope_main, rope_compress = parse_rope(raw, config.head_dim, raw["index_head_dim"], "V4")
        rates = dict(raw["compress_rates"])
        if any(rates[t] < 1 for t in set(layer_types) - {SLIDING}):
            raise ValueError(f"compress_rates must be >= 1, got {rates}")
        return cls(
            hidden_size=config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
            rope_dim=rope_dim, q_lora_rank=raw["q_lora_rank"], o_groups=raw["o_groups"],
            o_lora_rank=raw["o_lora_rank"], layer_types=layer_types, mlp_layer_types=mlp_types,
            compress_rates=rates, sliding_window=raw["sliding_window"], index_n_heads=raw["index_n_heads"],
            index_head_dim=raw["index_head_dim"], index_topk=raw["index_topk"], hc_mult=raw["hc_mult"],
            hc_sinkhorn_iters=raw["hc_sinkhorn_iters"], hc_eps=float(raw["hc_eps"]),
            n_routed_experts=raw["n_routed_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            routed_scaling_factor=float(raw["routed_scaling_factor"]), scoring_func=raw["scoring_func"],
            swiglu_limit=float(raw["swiglu_limit"]), rms_norm_eps=config.rms_norm_eps,
            max_position=config.max_position, rope_main=rope_main, rope_compress=rope_compress)

    def ratio(self, layer_type: str) -> int:
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    def ratios(self) -> tuple[int, ...]:
        """Distinct compression ratios in use (each gets one set of window indices per batch)."""
        return tuple(sorted({self.ratio(t) for t in self.layer_types} - {0}))


_RELEASE_YARN = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "original_max_position_embeddings": 65536}
"""The releases' YaRN of compressed layers, for a raw config without rope_scaling."""


def parse_rope(raw: dict, head_dim: int, index_head_dim: int, family: str) -> tuple[int, dict, dict]:
    """(rope_dim, main, compress) of a V4-family config: the RoPE width, and the HF rope parameters of sliding
    layers ('main', plain RoPE) and of compressed layers and their compressors ('compress', YaRN).

    transformers' DeepseekV4Config has nested them already as rope_parameters {'main', 'compress'} (taken as they
    are); a config read raw (V4.1) gives them as rope_theta, and rope_scaling with compress_rope_theta."""
    rope_dim = int(raw["qk_rope_head_dim"])
    if rope_dim % 2 or rope_dim > min(head_dim, index_head_dim):
        raise ValueError(f"qk_rope_head_dim ({rope_dim}) must be even and fit head_dim and index_head_dim")
    nested = raw.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        return rope_dim, dict(nested["main"]), dict(nested["compress"])
    yarn = dict(raw.get("rope_scaling") or _RELEASE_YARN)
    yarn.setdefault("rope_type", yarn.pop("type", "yarn"))
    if yarn["rope_type"] != "yarn":
        raise ValueError(f"rope_scaling.rope_type must be 'yarn' (compressed layers), got {yarn['rope_type']!r}")
    for key in ("mscale", "mscale_all_dim"):
        if yarn.get(key) not in (None, 0, 1, 1.0):
            raise ValueError(f"rope_scaling.{key} is not supported for {family}, got {yarn[key]!r}")
    compress = {k: float(v) if k in ("factor", "beta_fast", "beta_slow") else v for k, v in yarn.items()
                if k not in ("mscale", "mscale_all_dim")}
    compress["rope_theta"] = float(raw.get("compress_rope_theta", 160000.0))
    main = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000.0))}
    return rope_dim, main, compress


@dataclass(frozen=True)
class PoolColumns:
    """Column ranges of one layer's per-token pool row (see the module docstring); width 0 = absent."""

    swa: slice
    kv: slice
    gate: slice
    entry: slice
    idx_kv: slice
    idx_gate: slice
    idx_entry: slice

    @property
    def width(self) -> int:
        return max(s.stop for s in (self.swa, self.kv, self.gate, self.entry, self.idx_kv, self.idx_gate,
                                    self.idx_entry))

    @classmethod
    def for_layer(cls, cfg: V4Config, layer_type: str) -> "PoolColumns":
        d, di = cfg.head_dim, cfg.index_head_dim
        c = 2 if layer_type == CSA else 1
        widths = [d]
        if layer_type != SLIDING:
            widths += [c * d, c * d, d]
        else:
            widths += [0, 0, 0]
        widths += [2 * di, 2 * di, di] if layer_type == CSA else [0, 0, 0]
        bounds, start = [], 0
        for w in widths:
            bounds.append(slice(start, start + w))
            start += w
        return cls(*bounds)


    @classmethod
    def compact(cls, cfg: V4Config, layer_type: str, fp8: bool = False) -> "PoolColumns":
        """Columns of the compact pool (models/deepseek_v4/cache.py): swa, kv, gate, idx_kv, idx_gate in the
        layer's recent row, entry and idx_entry in its entry row; with `fp8` the sliding key and the entries
        are stored apart (LayerKV's Fp8Rows) and their columns here are empty."""
        full = cls.for_layer(cfg, layer_type)
        if fp8:
            empty = slice(0, 0)
            full = cls(empty, full.kv, full.gate, empty, full.idx_kv, full.idx_gate, empty)
        widths = [s.stop - s.start for s in (full.swa, full.kv, full.gate, full.idx_kv, full.idx_gate)]
        cuts = [0]
        for w in widths:
            cuts.append(cuts[-1] + w)
        swa, kv, gate, idx_kv, idx_gate = (slice(a, b) for a, b in zip(cuts, cuts[1:]))
        d_entry, d_idx = full.entry.stop - full.entry.start, full.idx_entry.stop - full.idx_entry.start
        return cls(swa, kv, gate, slice(0, d_entry), idx_kv, idx_gate, slice(d_entry, d_entry + d_idx))

    @property
    def recent_width(self) -> int:
        return max(s.stop for s in (self.swa, self.kv, self.gate, self.idx_kv, self.idx_gate))

    @property
    def entry_width(self) -> int:
        return max(self.entry.stop, self.idx_entry.stop)


FP8_MAX = 448.0
"""Largest finite float8 e4m3 value."""


@dataclass(frozen=True)
class Fp8Rows:
    """Rows stored as float8 e4m3 with one fp32 scale per row (amax / 448)."""

    values: torch.Tensor
    scales: torch.Tensor
    """(rows, 1) fp32."""
    pdl: bool = False
    """Writes on CUDA as programmatic dependent launches (DEEPINFER_GPU_PDL)."""

    @classmethod
    def zeros(cls, rows: int, width: int, device: torch.device, pdl: bool = False) -> "Fp8Rows":
        return cls(torch.zeros(rows, width, dtype=torch.float8_e4m3fn, device=device),
                   torch.zeros(rows, 1, dtype=torch.float32, device=device), pdl)

    def read(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.values[idx].float() * self.scales[idx]).to(dtype)

    def write(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        """Rows x (N, width) quantized into rows idx (N,) >= 0. On CUDA one Triton launch (store_rows) where the
        torch form takes nine, with the same bits: torch divides by the Python constant as a product with its
        reciprocal there, as the kernel does."""
        if x.is_cuda:
            return self.store_rows(idx, x)
        xf = x.float()
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        self.values[idx] = (xf / scale).to(torch.float8_e4m3fn)
        self.scales[idx] = scale

    def store_rows(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        from deepinfer_kernels.elementwise import store_kv_fp8  # Triton: CUDA (or its interpreter) only

        x = x if x.stride(-1) == 1 else x.contiguous()
        store_kv_fp8(self.values[:, None, :], self.scales, idx, x[:, None, :], pdl=self.pdl)


_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Midpoints between consecutive e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6."""


def fp4_block(width: int) -> int:
    """Values per e8m0 scale of an MXFP4 row `width` wide: 32 (the MX block) where it divides the width, else 16
    (narrow test models; TensorRT-LLM's block for V4.1 entries)."""
    for block in (MX_BLOCK, MX_BLOCK // 2):
        if width % block == 0:
            return block
    raise ValueError(f"MXFP4 rows need a width that is a multiple of {MX_BLOCK // 2}, got {width}")


def fp4_row_bytes(width: int) -> int:
    """Bytes of one Fp4Rows row: half a byte per value and a scale byte per block."""
    return width // 2 + width // fp4_block(width)


@dataclass(frozen=True)
class Fp4Rows:
    """Rows stored as MXFP4: e2m1 values packed two per byte (element 2j in the low nibble) and an e8m0 scale
    byte (2^(byte - 127)) per block of fp4_block(width) columns (32 at V4.1-Flash widths), the smallest power of
    two that keeps the block's amax within 6 (no value clips). Like Fp8Rows, a row's stored bits depend on its
    own values only."""

    values: torch.Tensor
    """(rows, width / 2) uint8."""
    scales: torch.Tensor
    """(rows, width / block) uint8, biased exponents."""

    @classmethod
    def zeros(cls, rows: int, width: int, device: torch.device) -> "Fp4Rows":
        return cls(torch.zeros(rows, width // 2, dtype=torch.uint8, device=device),
                   torch.zeros(rows, width // fp4_block(width), dtype=torch.uint8, device=device))

    @property
    def block(self) -> int:
        return 2 * self.values.shape[1] // self.scales.shape[1]

    # Both directions are elementwise arithmetic on the device (no lookup tables copied from the host), so a
    # CUDA-graph step can store and read them.
    def read(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        packed = self.values[idx]
        code = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int32)
        e, half = (code >> 1) & 3, (code & 1).float() * 0.5
        mag = torch.where(e == 0, half, torch.ldexp(1.0 + half, e - 1))  # 0, 0.5 | 1, 1.5, 2, 3, 4, 6
        values = torch.where(code >= 8, -mag, mag)
        exp = self.scales[idx].to(torch.int32) - 127
        blocks = values.unflatten(-1, (-1, self.block))
        return torch.ldexp(blocks, exp[..., None]).flatten(-2).to(dtype)

    def write(self, idx: torch.Tensor, x: torch.Tensor) -> None:
        blocks = x.float().unflatten(-1, (-1, self.block))
        exp = torch.ceil(torch.log2(blocks.abs().amax(dim=-1) / E2M1_MAX)).clamp(-127, 127).to(torch.int32)
        scaled = torch.ldexp(blocks, -exp[..., None]).flatten(-2)
        mag = scaled.abs()
        # the nearest e2m1 magnitude: how many midpoints lie below (a tie goes to the smaller one)
        code = sum((mag > m).to(torch.uint8) for m in _E2M1_MIDPOINTS) + (scaled < 0).to(torch.uint8) * 8
        pairs = code.unflatten(-1, (-1, 2))
        self.values[idx] = pairs[..., 0] | (pairs[..., 1] << 4)
        self.scales[idx] = (exp + 127).to(torch.uint8)


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV state and where each part lives: `recent` rows hold per-token state (sliding key,
    compressor inputs), `entries` rows the compressed entries; in the per-token layout both are the same pool
    rows. With FP8 storage the sliding keys, entries and indexer entries are Fp8Rows of their own (their
    columns in `cols` are then empty); with kv_cache_dtype 'fp4_e2m1' the entries and indexer entries are
    Fp4Rows instead (fp4_entry / fp4_idx_entry, the fp8 ones None) and the sliding keys stay Fp8Rows."""

    recent: torch.Tensor
    entries: torch.Tensor
    cols: PoolColumns
    fp8_swa: Fp8Rows | None = None
    fp8_entry: Fp8Rows | None = None
    fp8_idx_entry: Fp8Rows | None = None
    fp4_entry: Fp4Rows | None = None
    fp4_idx_entry: Fp4Rows | None = None

    @property
    def num_recent_rows(self) -> int:
        return self.recent.shape[0]

    @property
    def num_entry_rows(self) -> int:
        rows = self.fp8_entry if self.fp8_entry is not None else self.fp4_entry
        return self.entries.shape[0] if rows is None else rows.values.shape[0]

    @property
    def is_fp4(self) -> bool:
        """Whether the entries or indexer entries are MXFP4 rows (readers that take only FP8 rows refuse them)."""
        return self.fp4_entry is not None or self.fp4_idx_entry is not None

    def swa(self, idx: torch.Tensor) -> torch.Tensor:
        """Sliding keys at recent slots idx (any shape) -> (*idx.shape, D)."""
        if self.fp8_swa is not None:
            return self.fp8_swa.read(idx, self.recent.dtype)
        return self.recent[:, self.cols.swa][idx]

    def entry(self, idx: torch.Tensor) -> torch.Tensor:
        if self.fp8_entry is not None:
            return self.fp8_entry.read(idx, self.recent.dtype)
        if self.fp4_entry is not None:
            return self.fp4_entry.read(idx, self.recent.dtype)
        return self.entries[:, self.cols.entry][idx]

    def idx_entry(self, idx: torch.Tensor) -> torch.Tensor:
        if self.fp8_idx_entry is not None:
            return self.fp8_idx_entry.read(idx, self.recent.dtype)
        if self.fp4_idx_entry is not None:
            return self.fp4_idx_entry.read(idx, self.recent.dtype)
        return self.entries[:, self.cols.idx_entry][idx]

    def store_swa(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        if self.fp8_swa is not None:
            self.fp8_swa.write(slots, x)
        else:
            self.recent[slots, self.cols.swa] = x.to(self.recent.dtype)

    def store_entry(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        if self.fp8_entry is not None:
            self.fp8_entry.write(rows, x)
        elif self.fp4_entry is not None:
            self.fp4_entry.write(rows, x)
        else:
            self.entries[rows, self.cols.entry] = x.to(self.entries.dtype)

    def store_idx_entry(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        if self.fp8_idx_entry is not None:
            self.fp8_idx_entry.write(rows, x)
        elif self.fp4_idx_entry is not None:
            self.fp4_idx_entry.write(rows, x)
        else:
            self.entries[rows, self.cols.idx_entry] = x.to(self.entries.dtype)


def recent_tokens(cfg: V4Config) -> int:
    """Positions before a step's first new token whose per-token state the step reads: the sliding window's
    W - 1, and the windows its compressors complete (CSA pools the previous window too: 2m - 1)."""
    need = [cfg.sliding_window - 1]
    for t in set(cfg.layer_types) - {SLIDING}:
        need.append((2 if t == CSA else 1) * cfg.ratio(t) - 1)
    return max(need)


def inv_freq(cfg: V4Config, params: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rope_dim / 2,) and cos/sin scale of one rope-parameter set, from transformers'
    own definitions (YaRN included) so they cannot drift. Always computed on the CPU (also while a model is
    built on the meta device)."""
    with torch.device("cpu"):
        return _inv_freq(cfg, params)


def _inv_freq(cfg: V4Config, params: dict) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = cfg.rope_dim
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = DeepseekV4Config(head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads,
                          partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
                          max_position_embeddings=cfg.max_position,
                          rope_parameters={"main": dict(cfg.rope_main), "compress": dict(params)})
    freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), layer_type="compress")
    return freq.float(), float(scale)


class V4Rotary:
    """cos/sin tables (rope_dim / 2 per position) for one rope-parameter set; RoPE rotates adjacent channel
    pairs of the trailing rope_dim channels, leaving the leading ones alone.

    The layers share one V4Rotary per parameter set. Within one forward pass (`step_cache`) the tables of a
    positions tensor are computed once and reused by every later layer (five launches each, a CUDA graph's
    included); the cache lives only for that pass, keyed by the tensor and its version (an in-place change
    recomputes)."""

    def __init__(self, cfg: V4Config, params: dict):
        # Plain attributes, not buffers: casting the model to bfloat16 must not round the frequencies.
        self.inv_freq, self.scale = inv_freq(cfg, params)
        self._cache: dict | None = None
        """(id, version) of a positions tensor -> (positions, cos, sin), during a forward pass only."""

    def cos_sin(self, positions: torch.Tensor, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables of `positions`, (N, rope_dim / 2) fp32; `inverse`: (cos, -sin), which undo the
        rotation (shared within a forward pass as the tables are)."""
        # Inference-mode tensors keep no version counter: their tables are not shared.
        key = None if self._cache is None or positions.is_inference() else (id(positions), positions._version)
        if key is not None and inverse:
            key = key + ("inverse",)
        if key in (self._cache or {}):
            return self._cache[key][1:]
        if inverse:
            cos, sin = self.cos_sin(positions)
            sin = -sin
        else:
            if self.inv_freq.device != positions.device:
                self.inv_freq = self.inv_freq.to(positions.device)
            freqs = positions[:, None].float() * self.inv_freq[None, :]
            cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        if key is not None:
            self._cache[key] = (positions, cos, sin)  # the reference keeps the id from being reused meanwhile
        return cos, sin

    @contextlib.contextmanager
    def step_cache(self):
        """Share the tables between the layers of one forward pass."""
        self._cache = {}
        try:
            yield
        finally:
            self._cache = None


@contextlib.contextmanager
def shared_tables(rotaries):
    """V4Rotary.step_cache of each of `rotaries` for one forward pass."""
    with contextlib.ExitStack() as stack:
        for r in rotaries:
            stack.enter_context(r.step_cache())
        yield


class V4RMSNorm(nn.Module):
    """RMSNorm whose fp32 gain multiplies the fp32 normalised input before the one cast back (the V4
    reference keeps norm gains in fp32; the model keeps them so, see DeepseekV4ForCausalLM._apply)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.method = v4_method(current_kernel_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.rms_norm(x, self.weight, self.eps)

