"""Offline throughput: our Engine vs transformers `generate` (batched, same prompts), in one run.

    python benchmark/bench_offline.py [--num-prompts 64] [--max-new-tokens 128] [--dtype float32]

Both sides generate exactly max_new_tokens per prompt (ours: ignore_eos; transformers: min_new_tokens), so
they do the same work. Prints tok/s of each and the ratio; writes benchmark/results/offline_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
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


def run_ours(engine: Engine, prompts: list[str], max_new: int) -> tuple[float, int]:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, sampling_params=sp)
    return time.perf_counter() - t, sum(o.completion_tokens for o in outs)


def run_hf(model, tokenizer, prompts: list[str], max_new: int) -> tuple[float, int]:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return time.perf_counter() - t, (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]


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
    ours, theirs = [], []
    for _ in range(args.repeats):
        s, n = run_ours(engine, prompts, args.max_new_tokens)
        ours.append(n / s)
        s, n = run_hf(hf, engine.tokenizer, prompts, args.max_new_tokens)
        theirs.append(n / s)
    o, h = statistics.median(ours), statistics.median(theirs)
    result = {
        "benchmark": "offline", "model": args.model, "device": args.device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "ours_tok_s": o, "transformers_tok_s": h, "ratio": o / h, "ours_runs": ours, "transformers_runs": theirs,
    }
    print(f"ours {o:.1f} tok/s | transformers generate {h:.1f} tok/s | ratio {o / h:.2f}x")
    out = Path(args.out or Path(__file__).parent / "results" / f"offline_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
