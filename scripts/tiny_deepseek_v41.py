"""Tiny random DeepSeek-V4.1 checkpoints (make_tiny_checkpoint.py deepseek_v41 DIR): config.json (the HF composite
`deepseek_v41` with `text_config` and no vision tower) + model.safetensors, fixed seed.

transformers has no V4.1 classes, so the tensor list is written out here from the config, one entry per checkpoint
name. `names="release"` writes the release's names instead (no `model.` prefix, `embed.weight`) next to an
`inference/config.json` with the reference code's config names.

Two configs (TINY_CONFIGS) together cover every layer kind: ratio 0 / 1 / 2, KV sources and their readers, index
sources and top-k reusers, a candidate source with a later index source inside its blocks, Engram layers, YOCO
consumers (one of them a KV source), shifted and non-shifted mHC.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_COMMON = dict(
    hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, head_dim=16, qk_rope_head_dim=8,
    q_lora_rank=24, o_groups=2, o_lora_rank=8, n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
    swiglu_limit=0.6, rms_norm_eps=1e-20, hc_eps=1e-6, hc_sinkhorn_iters=20, sliding_window=4, index_n_heads=2,
    index_head_dim=16, index_topk=3, candidate_topk_blocks=2, candidate_block_size=2, rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=4096,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 64},
    engram_max_ngram_size=3, engram_vocab_size=31, engram_n_heads=2, engram_head_dim=8, engram_pad_token_id=2,
    gate_temp=1.0, tie_word_embeddings=False,
)
TINY_CONFIGS = {
    # shifted mHC, 2 streams; ratio-1 band (kv 2; index 2, 3; layer 4 reuses 3's top-k), ratio-2 band (kv 5;
    # candidate source 5, index source 7 inside its blocks; 6 reuses 5's); Engram on 1 and 3; YOCO from 6.
    "a": dict(_COMMON, num_hidden_layers=8, hc_mult=2, hc_shifted=True, compress_ratios=[0, 0, 1, 1, 1, 2, 2, 2],
              kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 3, 5, 7], candidate_source_layer_id=5,
              engram_layer_ids=[1, 3], n_prefill_layer=6),
    # non-shifted mHC (V4's head), 4 streams; a long-range first layer; a YOCO consumer that is a KV source;
    # the candidate source in a ratio-1 band.
    "b": dict(_COMMON, num_hidden_layers=6, hc_mult=4, hc_shifted=False, compress_ratios=[1, 0, 2, 2, 1, 1],
              kv_source_layer_ids=[0, 2, 4], index_source_layer_ids=[0, 2, 3, 4, 5], candidate_source_layer_id=4,
              engram_layer_ids=[1], n_prefill_layer=4),
}


# The DSpark drafter (make_v41_checkpoint(dspark=True)): 2 stages over a 3-position block, reading an Engram layer's
# and a YOCO consumer's inputs, with its own 2-expert bank.
DSPARK = dict(num_nextn_predict_layers=2, dspark_block_size=3, dspark_target_layer_ids=[1, 6], dspark_markov_rank=4,
              dspark_n_routed_experts=2, dspark_num_experts_per_tok=1)


def _primes(c: dict) -> dict[int, list[int]]:
    """Table sizes per Engram layer: for each n-gram order and head the next prime above engram_vocab_size - 1 not
    used before (by any layer)."""
    def is_prime(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    seen, out = set(), {}
    for layer in c["engram_layer_ids"]:
        sizes = []
        for _ in range(2, c["engram_max_ngram_size"] + 1):
            p = c["engram_vocab_size"] - 1
            for _ in range(c["engram_n_heads"]):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                sizes.append(p)
        out[layer] = sizes
    return out


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint name (HF spelling) -> shape, for a V4.1 text config."""
    d, h, dh, n = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    hi, di, e, i_moe = c["index_n_heads"], c["index_head_dim"], c["n_routed_experts"], c["moe_intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,),
              "head.weight": (c["vocab_size"], d)}
    if not c["hc_shifted"]:
        shapes.update({"model.hc_head.hc_fn": (n, n * d), "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,)})
    idx_src, kv_src = set(c["index_source_layer_ids"]), set(c["kv_source_layer_ids"])
    tables = _primes(c)
    for i in range(c["num_hidden_layers"]):
        p, ratio = f"model.layers.{i}.", c["compress_ratios"][i]
        for kind in ("attn", "ffn"):
            shapes.update({p + f"{kind}_norm.weight": (d,), p + f"hc_{kind}_fn": ((2 + n) * n, n * d),
                           p + f"hc_{kind}_base": ((2 + n) * n,), p + f"hc_{kind}_scale": (3,)})
        a = p + "attn."
        q_out = h * dh + (hi * di if i in idx_src else 0)
        shapes.update({a + "wq_a.weight": (c["q_lora_rank"], d), a + "q_norm.weight": (c["q_lora_rank"],),
                       a + "wq_b.weight": (q_out, c["q_lora_rank"]), a + "wkv.weight": (dh, d), a + "norm.weight": (dh,),
                       a + "wo_a.weight": (c["o_groups"] * c["o_lora_rank"], h * dh // c["o_groups"]),
                       a + "wo_b.weight": (d, c["o_groups"] * c["o_lora_rank"]), a + "attn_sink": (h,)})
        if i in kv_src:
            shapes.update({a + "compressor.wkv.weight": (dh, d), a + "compressor.norm.weight": (dh,),
                           a + "indexer.wk.weight": (di, dh), a + "indexer.k_norm.weight": (di,)})
            if ratio == 2:
                shapes[a + "compressor.wgate.weight"] = (dh, d)
        if i in idx_src:
            shapes[a + "indexer.weights_proj.weight"] = (hi, d)
        f = p + "ffn."
        shapes.update({f + "gate.weight": (e, d), f + "gate.bias": (e,)})
        for x in range(e):
            shapes.update({f + f"experts.{x}.w1.weight": (i_moe, d), f + f"experts.{x}.w3.weight": (i_moe, d),
                           f + f"experts.{x}.w2.weight": (d, i_moe)})
        shapes.update({f + "shared_experts.w1.weight": (i_moe, d), f + "shared_experts.w3.weight": (i_moe, d),
                       f + "shared_experts.w2.weight": (d, i_moe)})
        if i in tables:
            g = p + "engram."
            cols = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
            shapes.update({g + "embed.weight": (sum(tables[i]), c["engram_head_dim"]),
                           g + "wkv.weight": ((n + 1) * d, cols * c["engram_head_dim"]),
                           g + "hidden_norm.weight": (n, d), g + "embed_norm.weight": (n, d)})
    if c.get("dspark_block_size"):
        shapes.update(dspark_shapes(c))
    return shapes


def dspark_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The DSpark stages' tensors (`mtp.{s}.*`, the same in HF and release spellings)."""
    d, h, dh, n, r = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"], c["dspark_markov_rank"]
    e, i_moe, num = c["dspark_n_routed_experts"], c["moe_intermediate_size"], c["num_nextn_predict_layers"]
    shapes = {}
    for s in range(num):
        p = f"mtp.{s}."
        for kind in ("attn", "ffn"):
            shapes.update({p + f"{kind}_norm.weight": (d,), p + f"hc_{kind}_fn": ((2 + n) * n, n * d),
                           p + f"hc_{kind}_base": ((2 + n) * n,), p + f"hc_{kind}_scale": (3,)})
        a = p + "attn."
        shapes.update({a + "wq_a.weight": (c["q_lora_rank"], d), a + "q_norm.weight": (c["q_lora_rank"],),
                       a + "wq_b.weight": (h * dh, c["q_lora_rank"]), a + "wkv.weight": (dh, d),
                       a + "kv_norm.weight": (dh,), a + "attn_sink": (h,),
                       a + "wo_a.weight": (c["o_groups"] * c["o_lora_rank"], h * dh // c["o_groups"]),
                       a + "wo_b.weight": (d, c["o_groups"] * c["o_lora_rank"])})
        f = p + "ffn."
        shapes.update({f + "gate.weight": (e, d), f + "gate.bias": (e,)})
        for x in range(e):
            shapes.update({f + f"experts.{x}.w1.weight": (i_moe, d), f + f"experts.{x}.w3.weight": (i_moe, d),
                           f + f"experts.{x}.w2.weight": (d, i_moe)})
        shapes.update({f + "shared_experts.w1.weight": (i_moe, d), f + "shared_experts.w3.weight": (i_moe, d),
                       f + "shared_experts.w2.weight": (d, i_moe)})
    shapes.update({"mtp.0.main_proj.weight": (d, d * len(c["dspark_target_layer_ids"])), "mtp.0.main_norm.weight": (d,)})
    last = f"mtp.{num - 1}."
    shapes.update({last + "norm.weight": (d,), last + "markov_head.embed.weight": (c["vocab_size"], r),
                   last + "markov_head.head.weight": (c["vocab_size"], r),
                   last + "confidence_head.proj.weight": (1, d + r)})
    return shapes


def random_weights(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """Norm gains near 1, matrices std 0.1 (Engram tables std 1 so the gate matters), hyper-connection scales near
    1, router bias comparable to the score spread."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(c).items():
        noise = torch.randn(shape, generator=gen)
        if "norm" in name:
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith("_scale"):
            out[name] = 1.0 + 0.1 * noise
        elif "engram.embed." in name or name.endswith("attn_sink"):
            out[name] = noise
        elif name.endswith("gate.bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = 0.1 * noise
    return out


def release_name(name: str) -> str:
    name = name.removeprefix("model.")
    return "embed.weight" if name == "embed_tokens.weight" else name


def release_config(text: dict) -> dict:
    from deepinfer_rt.models.deepseek_v41.config import _RELEASE_NAMES, _RELEASE_ROPE

    back = {v: k for k, v in _RELEASE_NAMES.items()}
    out = {back[k]: v for k, v in text.items() if k in back}
    rope_back = {v: k for k, v in _RELEASE_ROPE.items()}
    out.update({rope_back[k]: v for k, v in text["rope_scaling"].items() if k in rope_back})
    out["dtype"] = "fp32"
    return out


def make_v41_checkpoint(out_dir: str | Path, tokenizer_dir: Path, seed: int = 0, variant: str = "a",
                        names: str = "hf", vocab_size: int | None = 20480, dspark: bool = False, **overrides) -> Path:
    """vocab_size: embedding rows (default 20480, the tokenizer's first ids: test prompts are id lists and the
    Engram vocabulary is derived from that many tokens); None = the whole tokenizer. dspark: add the DSpark
    drafter's config (DSPARK) and `mtp.*` tensors (drawn after the target's, which stay as without it)."""
    from transformers import AutoTokenizer

    if variant not in TINY_CONFIGS:
        raise ValueError(f"variant must be one of {sorted(TINY_CONFIGS)}, got {variant!r}")
    if names not in ("hf", "release"):
        raise ValueError(f"names must be 'hf' or 'release', got {names!r}")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tok) if vocab_size is None else min(vocab_size, len(tok))
    text = dict(TINY_CONFIGS[variant], vocab_size=vocab, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, model_type="deepseek_v41_text", **(DSPARK if dspark else {}), **overrides)
    if dspark:
        text.setdefault("dspark_noise_token_id", vocab - 1)
    text["engram_num_embeddings"] = [sum(s) for s in _primes(text).values()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(text, seed)
    if names == "release":
        weights = {release_name(k): v for k, v in weights.items()}
        (out / "inference").mkdir(exist_ok=True)
        (out / "inference" / "config.json").write_text(json.dumps(release_config(text), indent=1))
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
              "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
