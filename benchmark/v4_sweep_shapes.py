"""Model shapes, layer counts and decode floors of the DeepSeek-V4 / V4.1 decode sweep (bench_v4_sweep.py).

Shapes: the released V4-Flash and V4.1-Flash configs (deepinfer_rt/models/configs) at full width with N layers and E
routed experts, in bf16 or in the release format (FP8 e4m3 dense weights with e8m0 block scales -- 128 x 128 for V4,
32 x 32 for V4.1 -- and MXFP4 routed experts), for load_format="dummy". V4 takes the first N layers of the release
schedule. V4.1 is cut to N layers with the release's band structure and source spacing: ~5% sliding-only layers, then
a ratio-2 band (18/38 of the rest) with a KV + index source every 6 layers, then a ratio-1 band whose first layer is
the KV source, the candidate source and the first YOCO consumer, with an index source every 4 layers (N = 40 gives
the release's lists). No Engram layers (their tables are 384M rows each and add no KV) and no DSpark stages.

Layer count: the largest N whose meta-device build fits the device twice over -- while the dummy weights are drawn
(linears and experts in the run dtype as each is built, the rest in fp32, plus the largest fp32 temporary) and while
decoding (weights in the run dtype, the KV pool of the largest batch at the longest context, and a reserve for
activations, graphs and prefill).

Decode floor (shared/PERF.md): the bytes one decode step must read -- every always-used weight (not the embedding
table, the hash-routing table or Engram tables, which are gathered by row), per MoE layer the routed experts its
tokens touch (E (1 - (1 - k/E)^B) expected under uniform routing, or fewer where the step's routers picked fewer),
and per sequence the KV the architecture attends at its context: V4 each layer's sliding window, a CSA layer's
indexer keys and top-k entries, an HCA layer's entries; V4.1 each layer's sliding window and, once per KV source
(layers that share it read the same rows), its top-k entries and its index keys.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from deepinfer_rt.models.deepseek_v4.common import CSA, HCA, SLIDING

CONFIGS = Path(__file__).resolve().parents[1] / "deepinfer_rt" / "models" / "configs"
V4_FLASH, V41_FLASH = CONFIGS / "deepseek-v4-flash", CONFIGS / "deepseek-v41-flash"
SHAPES = ("v4", "v41")
FORMATS = ("bf16", "fp8")
"""'fp8': the release format (FP8 dense + MXFP4 experts), the weights as the checkpoints ship them."""
RELEASE_QUANT = {
    "v4": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
           "weight_block_size": [128, 128]},
    "v41": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32], "expert_dtype": "fp4"},
}
SMOKE_V4 = dict(hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, partial_rotary_factor=0.25,
                q_lora_rank=48, o_groups=2, o_lora_rank=16, moe_intermediate_size=32, num_experts_per_tok=2,
                index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=2, sliding_window=8,
                compress_rates={CSA: 4, HCA: 8}, vocab_size=1024)
"""CPU smoke runs: the same structure at a width a laptop builds in a second."""
SMOKE_V41 = dict(hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=48, o_groups=2,
                 o_lora_rank=16, moe_intermediate_size=32, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
                 index_topk=4, candidate_topk_blocks=4, candidate_block_size=2, sliding_window=8, hc_mult=2,
                 vocab_size=1024)
_LAYER = re.compile(r"layers\.(\d+)\.")


def v41_layers(n: int) -> dict:
    """The V4.1 text-config fields of an n-layer cut with the release's bands and source spacing (module doc)."""
    if n < 2:
        raise ValueError(f"a V4.1 cut needs at least 2 layers (ratio 2, ratio 1), got {n}")
    n0 = 0 if n == 2 else max(1, round(n * 2 / 40))  # 2 layers: no sliding-only layer
    n2 = min(n - n0 - 1, max(1, round((n - n0) * 18 / 38)))
    n1 = n - n0 - n2
    first1 = n0 + n2
    ratio2_sources = list(range(n0, first1, 6))
    return dict(num_hidden_layers=n, compress_ratios=[0] * n0 + [2] * n2 + [1] * n1,
                kv_source_layer_ids=ratio2_sources + [first1],
                index_source_layer_ids=ratio2_sources + list(range(first1, n, 4)),
                candidate_source_layer_id=first1, n_prefill_layer=first1)


def raw_config(shape: str, fmt: str, layers: int, experts: int, max_position: int, smoke: bool = False) -> dict:
    """config.json of an N-layer, E-expert V4-Flash / V4.1-Flash shape in `fmt` (module doc)."""
    if shape not in SHAPES or fmt not in FORMATS:
        raise ValueError(f"shape must be in {SHAPES} and format in {FORMATS}, got {shape!r}, {fmt!r}")
    if shape == "v4":
        raw = json.loads((V4_FLASH / "config.json").read_text())
        if not 1 <= layers <= raw["num_hidden_layers"]:
            raise ValueError(f"V4-Flash has {raw['num_hidden_layers']} layers, asked for {layers}")
        raw.update(num_hidden_layers=layers, layer_types=raw["layer_types"][:layers],
                   mlp_layer_types=raw["mlp_layer_types"][:layers], n_routed_experts=experts,
                   max_position_embeddings=max_position, num_nextn_predict_layers=0, **(SMOKE_V4 if smoke else {}))
        if fmt == "fp8":
            raw.update(quantization_config=dict(RELEASE_QUANT["v4"]), expert_dtype="fp4")
        return raw
    raw = json.loads((V41_FLASH / "config.json").read_text())
    text = dict(raw["text_config"], **v41_layers(layers), engram_layer_ids=[], engram_num_embeddings=[],
                num_nextn_predict_layers=0, n_routed_experts=experts, max_position_embeddings=max_position,
                **(SMOKE_V41 if smoke else {}))
    raw["text_config"] = text
    if fmt == "fp8":
        raw["quantization_config"] = dict(RELEASE_QUANT["v41"])
    return raw


def write_model_dir(raw: dict, out: Path) -> Path:
    """A folder with config.json and the DeepSeek tokenizer's files (the benchmark feeds token ids)."""
    from make_tiny_checkpoint import _TOKENIZER_FILES, _tokenizer_dir

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    tok = _tokenizer_dir("deepseek_v2")
    for name in _TOKENIZER_FILES:
        if (tok / name).exists():
            shutil.copy(tok / name, out / name)
    return out


def page_size_for(shape: str, raw: dict) -> int:
    """A page holding whole compression windows of every ratio (one compact entry row per window)."""
    if shape == "v41":
        return 128
    return math.lcm(*[int(m) for t, m in raw["compress_rates"].items() if t in raw["layer_types"] and t != SLIDING]
                    or [1])


def meta_model(path: Path, device: torch.device):
    """(ModelConfig, the model built on the meta device with the layer methods of `device`): no memory."""
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.models.loader import load_model_config
    from deepinfer_rt.models.registry import get_model_class

    config, _ = load_model_config(path)
    kc = KernelConfig.from_env(device).for_checkpoint(config.quantization)
    with torch.device("meta"), build_context(kc):
        model = get_model_class(config.architecture)(config)
    return config, model


def weight_memory(model, config, run_dtype: torch.dtype) -> dict:
    """Bytes of a meta-built model: while drawn and while running. The dummy build casts linears, embeddings and
    experts to the run dtype as each is built (models/loader._cast_as_built), so while drawn the model holds them in
    the run dtype and the rest (norms, mixing weights, routers: small) in fp32, plus its largest fp32 temporary: a
    cast module before its cast, the fp32 placeholders quantized experts replace, or a draw (blocks of leading
    slices past base.DUMMY_DRAW_ELEMENTS)."""
    from deepinfer_rt.models.base import DUMMY_DRAW_ELEMENTS
    from deepinfer_rt.models.loader import is_cast_as_built

    size = torch.empty((), dtype=run_dtype).element_size()
    build = run = temp = 0
    is_packed = False
    for module in model.modules():
        fp32_bytes = 0
        for name, p in module.named_parameters(recurse=False):
            n = p.numel()
            at_run = n * (size if p.dtype == torch.float32 else p.element_size())
            run += at_run
            build += at_run if is_cast_as_built(module) else n * p.element_size()
            if p.is_floating_point():
                fp32_bytes += 4 * n
                row = n // max(1, p.shape[0]) if p.dim() >= 2 else n
                draw = n if n <= DUMMY_DRAW_ELEMENTS or p.dim() < 2 else max(row, DUMMY_DRAW_ELEMENTS // row * row)
                temp = max(temp, 4 * draw)
            is_packed |= "experts" in type(module).__name__.lower() and not p.is_floating_point()
        if is_cast_as_built(module):
            temp = max(temp, fp32_bytes)
    # Quantized experts replace fp32 placeholders of the full expert shape, built first (deepseek_v4/moe.py).
    placeholder = 3 * config.n_routed_experts * config.hidden_size * config.moe_intermediate_size if is_packed else 0
    return {"build_bytes": build, "run_bytes": run, "build_temp_bytes": max(temp, 4 * placeholder)}


def pool_bytes(layout, tokens: int, page_size: int, dtype: torch.dtype) -> float:
    """Bytes of a compact pool of `tokens` main-pool tokens (V4Pool's buffers: entries per token, recent rows for
    max(recent_fraction x tokens, 16384) tokens)."""
    from deepinfer_rt.models.deepseek_v4.cache import _MIN_RECENT_TOKENS

    recent_tokens = min(tokens, max(math.ceil(layout.recent_fraction * tokens / page_size) * page_size,
                                    _MIN_RECENT_TOKENS))
    return tokens * layout.long_lived_bytes_per_token(dtype) + recent_tokens * layout.recent_bytes_per_token(dtype)


def kv_layout(model, config, kv_cache_dtype: str):
    layout = model.kv_layout(config)
    return layout.with_kv_dtype(kv_cache_dtype) if kv_cache_dtype != "auto" else layout


def layout_of(path: Path, kv_cache_dtype: str):
    """(ModelConfig, compact KV layout) of a model folder, without building the model."""
    from deepinfer_rt.models.loader import load_model_config
    from deepinfer_rt.models.registry import get_model_class

    config, _ = load_model_config(path)
    return config, kv_layout(get_model_class(config.architecture), config, kv_cache_dtype)


def kv_breakdown(layout, dtype: torch.dtype) -> dict:
    """Where a compact layout's bytes per token go: per kind of layer with entries (ratio, entry / indexer-entry row
    bytes with their scales) its layers and their share per token; per token of the recent rows, the sliding keys
    of all layers and the rest (a ratio-2 V4.1 source's compressor inputs, V4's compressor and indexer inputs,
    Engram ids)."""
    kinds: dict[tuple[int, int, int], list[int]] = {}
    for layer, m in enumerate(layout.ratios):
        if m:
            kinds.setdefault((m, *layout.entry_row_bytes(layer, dtype)), []).append(layer)
    sources = [dict(ratio=m, entry_bytes=entry, index_key_bytes=index_key, layers=layers,
                    bytes_per_token=round(len(layers) * (entry + index_key) / m, 1))
               for (m, entry, index_key), layers in kinds.items()]
    size = torch.empty((), dtype=dtype).element_size()
    swa = layout.num_swa_layers * (layout.swa_dim + 4 if layout.is_fp8 else layout.swa_dim * size)
    return dict(entries=sources, recent_sliding_key_bytes=swa,
                recent_other_bytes=layout.recent_bytes_per_token(dtype) - swa)


def full_kv_report(context: int = 32768) -> dict:
    """KV bytes per token of the full V4-Flash (43 layers) and V4.1-Flash (40 layers) configs in the compact pool
    beside SGLang's V4 pool and TensorRT-LLM's V4.1 layout: long-lived bytes per token (entries), recent bytes per
    token (held for about R tokens per sequence, and at checkpoints), the amortized figure of one sequence of
    `context` tokens that keeps R recent tokens per checkpoint, and where the bytes go (kv_breakdown). V4.1 also
    with kv_cache_dtype 'fp4_e2m1' (MXFP4 entries and index keys)."""
    import tempfile

    from bench_v4 import SGLANG_V4_BYTES, TRTLLM_V41_GLOBAL_BYTES, TRTLLM_V41_SWA_ROW_BYTES

    out = {}
    for shape, layers, kv_dtypes in (("v4", 43, ("auto", "fp8_e4m3")), ("v41", 40, ("auto", "fp8_e4m3", "fp4_e2m1"))):
        raw = raw_config(shape, "bf16", layers, 256, 1 << 20)
        if shape == "v41":
            full = json.loads((V41_FLASH / "config.json").read_text())["text_config"]
            raw["text_config"].update(n_routed_experts=full["n_routed_experts"])
        path = write_model_dir(raw, Path(tempfile.mkdtemp(prefix=f"v4sweep-kv-{shape}-")))
        rows = {}
        for kv_dtype in kv_dtypes:
            config, layout = layout_of(path, kv_dtype)
            bf16 = torch.bfloat16
            long_lived, recent = layout.long_lived_bytes_per_token(bf16), layout.recent_bytes_per_token(bf16)
            held = layout.recent_tokens + layout.recent_tokens * (context // layout.checkpoint_tokens)
            breakdown = kv_breakdown(layout, bf16)
            rows[kv_dtype] = dict(long_lived_bytes_per_token=round(long_lived, 1), recent_bytes_per_token=recent,
                                  recent_tokens=layout.recent_tokens, checkpoint_tokens=layout.checkpoint_tokens,
                                  window_bytes_per_sequence=layout.window_bytes_per_sequence(bf16),
                                  # the sliding keys alone (TensorRT-LLM's window figure counts only these)
                                  sliding_key_bytes_per_sequence=breakdown["recent_sliding_key_bytes"]
                                  * layout.recent_tokens,
                                  amortized_bytes_per_token=round(long_lived + recent * held / context, 1),
                                  context=context, breakdown=breakdown)
        if shape == "v4":
            rows["sglang_fp8_bytes_per_token"] = SGLANG_V4_BYTES
        else:
            rows["trtllm_long_range_bytes_per_token"] = TRTLLM_V41_GLOBAL_BYTES
            rows["trtllm_window_bytes_per_layer_row"] = TRTLLM_V41_SWA_ROW_BYTES
            rows["trtllm_window_bytes_per_sequence"] = TRTLLM_V41_SWA_ROW_BYTES * layers * config.raw[
                "text_config"]["sliding_window"]
        out[shape] = rows
    return out


# ---- decode floor ----

def weight_split(model, config) -> tuple[float, dict[int, float]]:
    """(bytes every decode step reads, {MoE layer: bytes of one of its routed experts})."""
    always, per_expert = 0.0, {}
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:
            layer = int(_LAYER.search(name)[1])
            per_expert[layer] = per_expert.get(layer, 0.0) + size / p.shape[0]
        elif "embed_tokens" in name and not config.tie_word_embeddings:
            continue  # gathered: B rows
        elif name.endswith("tid2eid") or ".engram.embed." in name:
            continue  # gathered tables
        else:
            always += size
    return always, per_expert


def expected_touched(num_experts: int, top_k: int, batch: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def attended_kv_bytes(shape: str, config, context: int, fp8: bool) -> int:
    """KV bytes one sequence's decode token must read at `context` tokens (module doc): bf16 rows, or FP8 rows of
    a byte per value and a 4-byte scale (V4 with kv_cache_dtype='fp8_e4m3')."""
    def rows(n: int, width: int) -> int:
        return n * (width + 4 if fp8 else 2 * width)

    if shape == "v4":
        from deepinfer_rt.models.deepseek_v4.common import V4Config

        cfg = V4Config.from_model_config(config)
        total = 0
        for t in cfg.layer_types:
            total += rows(min(cfg.sliding_window, context), cfg.head_dim)
            m = cfg.ratio(t)
            if m and t == CSA:
                total += rows(context // m, cfg.index_head_dim) + rows(min(cfg.index_topk, context // m), cfg.head_dim)
            elif m:
                total += rows(context // m, cfg.head_dim)
        return total
    from deepinfer_rt.models.deepseek_v41.config import V41Config

    cfg = V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"})
    total = sum(rows(min(context, cfg.sliding_window), cfg.head_dim) for _ in cfg.layers)
    for spec in cfg.layers:
        if spec.is_kv_source:
            entries = context // spec.ratio
            total += rows(min(cfg.index_topk, entries), cfg.head_dim) + rows(entries, cfg.index_head_dim)
    return total


def decode_floor(always: float, per_expert: dict[int, float], touched: dict[int, float], kv_per_seq: int,
                 batch: int, copy_bw: float) -> dict:
    """The floor of one decode step of `batch` sequences, `touched[layer]` experts read per MoE layer."""
    total = always + sum(touched[layer] * b for layer, b in per_expert.items()) + batch * kv_per_seq
    return {"floor_bytes": total, "floor_ms_per_step": total / copy_bw * 1e3, "floor_tok_s": batch * copy_bw / total}


# ---- prefill FLOPs ----

def prefill_flops(shape: str, model, config, tokens: int, num_seqs: int) -> float:
    """A lower bound of one prefill's FLOPs: 2 x active matmul parameters x tokens (routed experts at k of E; the
    LM head once per prompt) plus attention over the keys each query must score (causal, per position t: the
    sliding window, top-k entries and indexer keys as in attended_kv_bytes). `model`: the unquantized meta build."""
    active = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or name.endswith(("tid2eid", "head.weight")):
            continue
        active += p.numel() // config.n_routed_experts * config.num_experts_per_tok if ".experts." in name \
            else p.numel()
    t = torch.arange(tokens, dtype=torch.float64) + 1  # keys visible to each query
    if shape == "v4":
        from deepinfer_rt.models.deepseek_v4.common import V4Config

        cfg = V4Config.from_model_config(config)
        h, d, hi, di, w, k = (cfg.num_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window,
                              cfg.index_topk)
        layers = [(cfg.ratio(x), x == CSA) for x in cfg.layer_types]
    else:
        from deepinfer_rt.models.deepseek_v41.config import V41Config

        cfg = V41Config.from_raw({k_: v for k_, v in config.raw.items() if k_ != "_tokenizer_dir"})
        h, d, hi, di, w, k = (cfg.num_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window,
                              cfg.index_topk)
        layers = [(s.ratio, s.is_index_source and s.candidate_source is None) for s in cfg.layers]
    attn = 0.0
    for m, has_indexer in layers:
        keys = t.clamp(max=w)
        if m:
            entries = torch.div(t, m, rounding_mode="floor")
            keys = keys + (entries.clamp(max=k) if has_indexer or shape == "v41" else entries)
            if has_indexer:
                attn += float(2 * hi * di * entries.sum())
        attn += float(2 * h * 2 * d * keys.sum())  # QK and PV (K = V, width d)
    head = 2 * config.vocab_size * config.hidden_size
    return (2 * active * tokens + attn + head) * num_seqs
