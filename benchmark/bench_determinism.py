"""Cost of batch-invariant mode: offline throughput with the switch off vs on, same prompts, in one run.

    python benchmark/bench_determinism.py [--num-prompts 16] [--max-new-tokens 32] [--repeats 3]

Two engines (mode off, mode on) take turns on the same prompts (greedy, fixed output length) so machine drift
hits both alike; each figure is the median over repeats. Also checks that the mode-on outputs match between
the batched run and each prompt run alone (the property the mode buys). Writes
benchmark/results/determinism_cpu.json (determinism_<device>.json).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import chat, make_prompts  # noqa: E402


def run(engine: Engine, prompts: list[str], max_new: int):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True, logprobs=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, sampling_params=sp)
    elapsed = time.perf_counter() - t
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    return sum(o.completion_tokens for o in outs) / elapsed, (prompt_tokens + max_new * len(outs)) / elapsed, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engines = {mode: Engine(args.model, dtype=args.dtype, device=args.device, enable_prefix_cache=False,
                            batch_invariant=mode == "on") for mode in ("off", "on")}
    prompts = chat(engines["off"].tokenizer, make_prompts(args.num_prompts))
    for engine in engines.values():
        run(engine, prompts[:2], 4)  # warm-up
    decode, total, outs = {"off": [], "on": []}, {"off": [], "on": []}, {}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            d, t, outs[mode] = run(engine, prompts, args.max_new_tokens)
            decode[mode].append(d)
            total[mode].append(t)
    alone = [run(engines["on"], [p], args.max_new_tokens)[2][0] for p in prompts[:4]]
    invariant = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(alone, outs["on"]))
    med = {mode: statistics.median(decode[mode]) for mode in decode}
    result = {
        "benchmark": "determinism", "model": args.model, "device": args.device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "command": "python benchmark/bench_determinism.py " + " ".join(sys.argv[1:]),
        "off_output_tok_s": med["off"], "on_output_tok_s": med["on"], "on_over_off": med["on"] / med["off"],
        "overhead_pct": 100 * (med["off"] / med["on"] - 1),
        "off_total_tok_s": statistics.median(total["off"]), "on_total_tok_s": statistics.median(total["on"]),
        "off_runs": decode["off"], "on_runs": decode["on"],
        "on_batched_equals_alone": invariant,
    }
    print(f"output tok/s: off {med['off']:.1f}  on {med['on']:.1f}  ratio on/off {result['on_over_off']:.2f} "
          f"(overhead {result['overhead_pct']:.0f}%); mode-on batched == alone: {invariant}")
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"determinism_{args.device}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
