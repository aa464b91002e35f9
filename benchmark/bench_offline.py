"""Offline throughput: our Engine vs transformers `generate` (batched, same prompts), in one run.

    python benchmark/bench_offline.py [--num-prompts 64] [--max-new-tokens 128] [--dtype float32]

Two workloads, each run on both sides in the same process:
  fixed    every prompt generates exactly max_new_tokens (ours: ignore_eos; transformers: min_new_tokens):
           the same work on both sides.
  eos      generation stops at EOS (the real offline job). Throughput counts tokens up to and including each
           sequence's EOS; transformers keeps stepping finished rows until the longest is done, ours drops them.
Prints tok/s of each and the ratio; writes benchmark/results/offline_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.models.loader import resolve_model_path

TOPICS = ["the ocean", "a robot", "the moon", "coffee", "a lighthouse", "winter", "a library", "mountains",
          "a violin", "the desert", "a train journey", "gardening", "a thunderstorm", "old maps", "bees", "glass"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
         "Describe {} in one paragraph."]


def make_prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[(i // len(FORMS)) % len(TOPICS)]) + " " * (i // 64)
            for i in range(n)]


def chat(tokenizer, prompts: list[str]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def run_ours(engine: Engine, prompts: list[str], max_new: int, fixed: bool = True) -> tuple[float, int]:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=fixed)
    t = time.perf_counter()
    outs = engine.generate(prompts, sampling_params=sp)
    return time.perf_counter() - t, sum(o.completion_tokens for o in outs)


def run_hf(model, tokenizer, prompts: list[str], max_new: int, fixed: bool = True) -> tuple[float, int]:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new if fixed else 0,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or eos)
    elapsed = time.perf_counter() - t
    new = out[:, enc.input_ids.shape[1]:].tolist()
    return elapsed, sum(row.index(eos) + 1 if eos in row else len(row) for row in new)


def matmul_flops(dtype: torch.dtype, device: str, rows: int, hidden: int) -> float:
    """Measured FLOP/s of a decode-shaped GEMM (rows x hidden @ hidden x 4*hidden) on this machine."""
    a = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.randn(4 * hidden, hidden, dtype=dtype, device=device)
    for _ in range(5):
        torch.nn.functional.linear(a, w)
    n, t = 50, time.perf_counter()
    for _ in range(n):
        torch.nn.functional.linear(a, w)
    return 2 * rows * w.numel() * n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    engine = Engine(args.model, dtype=args.dtype, device=args.device, enable_prefix_cache=False)
    prompts = chat(engine.tokenizer, make_prompts(args.num_prompts))
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=engine.config.dtype).to(args.device)
    hf.eval()
    run_ours(engine, prompts[:4], 8)  # warm-up both
    run_hf(hf, engine.tokenizer, prompts[:4], 8)
    result = {
        "benchmark": "offline", "model": args.model, "device": args.device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "command": "python benchmark/bench_offline.py " + " ".join(sys.argv[1:]),
    }
    # Compute floor of decode: every token costs 2 FLOPs per weight it multiplies (all layers + LM head).
    params = sum(p.numel() for n, p in engine.model.named_parameters() if "embed_tokens" not in n)
    if engine.model_config.tie_word_embeddings:
        params += engine.model.lm_head.weight.numel()
    flops = matmul_flops(engine.config.dtype, args.device, min(args.num_prompts, 64), engine.model_config.hidden_size)
    result["matmul_flop_s"] = flops
    result["decode_compute_floor_tok_s"] = flops / (2 * params)
    print(f"decode-shaped GEMM {flops / 1e9:.0f} GFLOP/s -> compute floor {flops / (2 * params):.0f} tok/s "
          f"({params / 1e6:.0f}M weights per token)")
    for workload in ("fixed", "eos"):
        fixed = workload == "fixed"
        ours, theirs, ours_tokens, theirs_tokens = [], [], 0, 0
        for _ in range(args.repeats):
            s, ours_tokens = run_ours(engine, prompts, args.max_new_tokens, fixed)
            ours.append(ours_tokens / s)
            s, theirs_tokens = run_hf(hf, engine.tokenizer, prompts, args.max_new_tokens, fixed)
            theirs.append(theirs_tokens / s)
        o, h = statistics.median(ours), statistics.median(theirs)
        result[workload] = {"ours_tok_s": o, "transformers_tok_s": h, "ratio": o / h,
                            "fraction_of_compute_floor": o / result["decode_compute_floor_tok_s"], "ours_runs": ours,
                            "transformers_runs": theirs, "ours_tokens": ours_tokens,
                            "transformers_tokens": theirs_tokens}
        print(f"[{workload}] ours {o:.1f} tok/s | transformers generate {h:.1f} tok/s | ratio {o / h:.2f}x "
              f"(tokens: ours {ours_tokens}, transformers {theirs_tokens})")
    out = Path(args.out or Path(__file__).parent / "results" / f"offline_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
