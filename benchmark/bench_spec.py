"""Speculative decoding (prompt lookup) on SmolLM2: the engine with speculation on vs off, in one run.

    python benchmark/bench_spec.py [--batch-sizes 1 8 32] [--max-new-tokens 64] [--repeats 3]
    python benchmark/bench_spec.py --device cuda --dtype bfloat16   (writes benchmark/results/spec_h200.json)

Workloads whose outputs copy spans of their input (where prompt lookup drafts well):
  extraction     one person per prompt from examples/data/people.jsonl -> a JSON record (JSON-schema constrained)
  summarisation  three people's sentences per prompt -> a summary naming each person, job and city
Batch b = b requests submitted together (batch 1: one at a time). Greedy, so both modes must produce identical
tokens (checked). Reports tok/s of each mode (median over repeats, with spread), speedup, acceptance rate and
mean accepted drafts per verification; writes benchmark/results/spec_cpu.json (on cuda: spec_h200.json).
On a GPU, bf16 argmax ties can make the two modes differ legitimately (a verify step's rows are computed in a
different batch shape than single decode rows); `identical_outputs` then reports it rather than hiding it.
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

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "occupation": {"type": "string"}, "city": {"type": "string"}},
          "required": ["name", "age", "occupation", "city"]}


def chat(tokenizer, system: str, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                         tokenize=False, add_generation_prompt=True)


def workloads(tokenizer, n: int, max_new: int) -> dict[str, tuple[list[str], SamplingParams]]:
    texts = [json.loads(line)["text"] for line in (ROOT / "examples/data/people.jsonl").read_text().splitlines()]
    # Distinct prompts beyond the 12 sentences: a numbered record id keeps the cache and batching honest.
    extraction = [chat(tokenizer, "Extract the person as JSON with the keys name, age, occupation and city.",
                       f"Record {i}: {texts[i % len(texts)]}") for i in range(n)]
    summaries = [chat(tokenizer, "Summarise the report in one sentence per person: name, job and city.",
                      f"Report {i}: " + " ".join(texts[(i + j) % len(texts)] for j in range(3))) for i in range(n)]
    return {
        "extraction": (extraction, SamplingParams(max_new_tokens=max_new, temperature=0,
                                                  json_schema=json.dumps(SCHEMA))),
        "summarisation": (summaries, SamplingParams(max_new_tokens=max_new, temperature=0)),
    }


def run(engine: Engine, prompts: list[str], params: SamplingParams, batch: int) -> tuple[float, list]:
    outs, t = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], sampling_params=params)
    return time.perf_counter() - t, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-at-batch-1", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-draft", type=int, default=0, help="0: DEEPINFER_SPEC_MAX_DRAFT (default 5)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="default: benchmark/results/spec_cpu.json, or spec_h200.json on cuda")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(ROOT / "benchmark/results" / ("spec_h200.json" if args.device == "cuda" else "spec_cpu.json"))

    from deepinfer_rt.speculative import SpeculativeConfig

    common = dict(dtype=args.dtype, device=args.device, enable_prefix_cache=False, kv_cache_tokens=16384)
    engines = {"off": Engine(args.model, **common),
               "on": Engine(args.model, speculative=SpeculativeConfig("prompt_lookup", max_draft=args.max_draft),
                            **common)}
    tokenizer = engines["off"].tokenizer
    result = {"benchmark": "spec", "model": args.model, "dtype": args.dtype, "device": args.device,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": (torch.cuda.get_device_name() if args.device == "cuda"
                                                              else platform.processor() or platform.machine()),
              "command": "python benchmark/bench_spec.py " + " ".join(sys.argv[1:]), "runs": []}
    for batch in args.batch_sizes:
        n = args.prompts_at_batch_1 if batch == 1 else batch
        for name, (prompts, params) in workloads(tokenizer, n, args.max_new_tokens).items():
            for engine in engines.values():
                run(engine, prompts[:1], params, 1)  # warm-up (and grammar compilation)
            rates = {"off": [], "on": []}
            outs = {}
            before = dict(engines["on"].spec.stats())
            for _ in range(args.repeats):
                for mode, engine in engines.items():  # alternate, so load drifts hit both alike
                    seconds, outs[mode] = run(engine, prompts, params, batch)
                    rates[mode].append(sum(o.completion_tokens for o in outs[mode]) / seconds)
            after = engines["on"].spec.stats()
            drafted = after["drafted"] - before["drafted"]
            accepted = after["accepted"] - before["accepted"]
            off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
            spec = [o.spec_stats for o in outs["on"] if o.spec_stats]
            row = {"workload": name, "batch": batch, "num_prompts": n,
                   "tokens": sum(o.completion_tokens for o in outs["on"]),
                   "off_tok_s": off, "on_tok_s": on, "speedup": on / off,
                   "off_runs": rates["off"], "on_runs": rates["on"],
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_length": (sum(s["mean_accepted_length"] for s in spec) / len(spec)) if spec
                   else 0.0,
                   "identical_outputs": [o.token_ids for o in outs["on"]] == [o.token_ids for o in outs["off"]]}
            result["runs"].append(row)
            print(f"[{name} b={batch}] off {off:.1f} tok/s (spread {min(rates['off']):.1f}-{max(rates['off']):.1f})"
                  f" | on {on:.1f} tok/s (spread {min(rates['on']):.1f}-{max(rates['on']):.1f}) | speedup "
                  f"{on / off:.2f}x | acceptance {row['acceptance_rate']:.2f}, mean accepted "
                  f"{row['mean_accepted_length']:.2f} | identical {row['identical_outputs']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
