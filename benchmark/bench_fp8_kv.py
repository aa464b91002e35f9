"""Accuracy cost of the FP8 KV cache (kv_cache_dtype='fp8_e4m3') against bf16 KV, on CPU, random weights.

For each model and each of `--contexts` random `--context-len`-token prompts:
  1. the bf16-KV engine (model and KV in bf16) decodes `--new-tokens` greedy tokens;
  2. both engines score the prompt + those tokens teacher-forced (prompt_logprobs): |delta logprob| of the greedy
     tokens (and, apart, of every prompt position) between FP8 KV and bf16 KV, the same tokens in both;
  3. the FP8-KV engine decodes greedily on its own: how many leading tokens match bf16's, and |delta logprob| of
     the decode steps over that common prefix (the decode kernels' path, reading the FP8 cache);
  4. beside it, the model's own sensitivity: the same teacher-forced |delta logprob| of bf16 (model and KV)
     against float32 (model and KV). Deep random models amplify any rounding; FP8 KV is judged against that.
Models: the tiny random Llama of the tests (2 layers, 64 wide) and a SmolLM2-135M-shaped random Llama (30 layers,
576 wide, 9 heads over 3 KV heads of 64), both from scripts/make_tiny_checkpoint.py.

    python benchmark/bench_fp8_kv.py --out benchmark/results/fp8_kv_accuracy_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

from deepinfer_rt import Engine, SamplingParams  # noqa: E402

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True)
MODELS = {"tiny-llama": dict(max_position_embeddings=8192), "smollm2-135m-shape": SMOLLM2_SHAPE}


def _stats(deltas: torch.Tensor) -> dict:
    return dict(max=float(deltas.max()), mean=float(deltas.mean()), n=int(deltas.numel()))


def measure(path: Path, contexts: list[list[int]], new_tokens: int, kv_tokens: int) -> dict:
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=True)
    score = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=True)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        t0 = time.time()
        with Engine(str(path), dtype="bfloat16", kv_cache_tokens=kv_tokens, kv_cache_dtype=kv,
                    enable_prefix_cache=False) as e:
            decoded = e.generate(input_ids=contexts, sampling_params=greedy)
            ref_tokens = runs["auto"]["decoded"] if kv != "auto" else decoded
            forced = e.generate(input_ids=[c + o.token_ids for c, o in zip(contexts, ref_tokens)],
                                sampling_params=score)
        runs[kv] = dict(decoded=decoded, forced=forced, seconds=time.time() - t0)
    with Engine(str(path), dtype="float32", kv_cache_tokens=kv_tokens, enable_prefix_cache=False) as e:
        fp32 = e.generate(input_ids=[c + o.token_ids for c, o in zip(contexts, runs["auto"]["decoded"])],
                          sampling_params=score)
    bf16_vs_fp32 = torch.cat([(torch.tensor(x.prompt_logprobs[1:], dtype=torch.float64)
                               - torch.tensor(y.prompt_logprobs[1:], dtype=torch.float64)).abs()
                              for x, y in zip(runs["auto"]["forced"], fp32)])
    greedy_d, prompt_d, decode_d, matched = [], [], [], []
    for i, ctx in enumerate(contexts):
        a = torch.tensor(runs["auto"]["forced"][i].prompt_logprobs[1:], dtype=torch.float64)
        b = torch.tensor(runs["fp8_e4m3"]["forced"][i].prompt_logprobs[1:], dtype=torch.float64)
        d = (a - b).abs()
        prompt_d.append(d[: len(ctx) - 1])
        greedy_d.append(d[len(ctx) - 1 :])  # the positions of the bf16 engine's greedy tokens
        ra, rb = runs["auto"]["decoded"][i], runs["fp8_e4m3"]["decoded"][i]
        n = next((j for j, (x, y) in enumerate(zip(ra.token_ids, rb.token_ids)) if x != y), len(ra.token_ids))
        matched.append(n)
        decode_d.append((torch.tensor(ra.logprobs[:n], dtype=torch.float64)
                         - torch.tensor(rb.logprobs[:n], dtype=torch.float64)).abs())
    return dict(
        greedy_tokens_teacher_forced=_stats(torch.cat(greedy_d)),
        context_positions_teacher_forced=_stats(torch.cat(prompt_d)),
        decode_common_prefix=_stats(torch.cat(decode_d)) if sum(matched) else None,
        reference_bf16_vs_fp32_teacher_forced=_stats(bf16_vs_fp32),
        greedy_tokens_matched=matched, new_tokens=new_tokens,
        seconds={kv: round(r["seconds"], 1) for kv, r in runs.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmark/results/fp8_kv_accuracy_cpu.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    results = dict(context_len=args.context_len, contexts=args.contexts, model_dtype="bfloat16",
                   baseline_kv="bfloat16 (kv_cache_dtype='auto')", device="cpu", models={})
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = make_tiny_checkpoint("llama", Path(tmp) / name, seed=0, **MODELS[name])
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            contexts = [torch.randint(10, vocab, (args.context_len,), generator=g).tolist()
                        for _ in range(args.contexts)]
            kv_tokens = args.contexts * (args.context_len + args.new_tokens + 8)
            results["models"][name] = row = measure(path, contexts, args.new_tokens, kv_tokens)
            print(name, json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
