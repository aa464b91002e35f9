"""Structured-output overhead: JSON-schema-constrained vs unconstrained decoding of the same prompts, one run.

    python benchmark/bench_structured.py [--batch 32] [--max-new-tokens 128] [--model smollm2-135m-instruct]

Both sides decode the same chat prompts with the same max_new_tokens and without ignore_eos (a constrained
request ends where its JSON does), greedy, so throughput is completion tokens per second of each run. The
mask time per constrained token (bitmask fill plus its share of the apply) comes from the engine's grammar
backend. Writes benchmark/results/structured_<device>.json.
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

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "minLength": 1, "maxLength": 40},
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "occupation", "city"],
}
JOBS = ["nurse", "pilot", "baker", "teacher", "engineer", "painter", "farmer", "lawyer"]
CITIES = ["Madrid", "Osaka", "Lagos", "Lima", "Oslo", "Cairo", "Perth", "Quebec"]


def make_prompts(tokenizer, n: int) -> list[str]:
    ask = ("Invent a fictional {job} who lives in {city}. Reply with a JSON object with the keys name, age, "
           "occupation, city and hobbies.")
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": ask.format(job=JOBS[i % len(JOBS)], city=CITIES[(i // len(JOBS)) % len(CITIES)])}],
        tokenize=False, add_generation_prompt=True) for i in range(n)]


def timed(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, list]:
    t = time.perf_counter()
    outs = engine.generate(prompts, sampling_params=params)
    return time.perf_counter() - t, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jsonschema

    # No prefix cache: the second run of a prompt would otherwise skip its prefill and look faster.
    engine = Engine(args.model, dtype=args.dtype, device=args.device, enable_prefix_cache=False)
    prompts = make_prompts(engine.tokenizer, args.batch)
    constrained = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, json_schema=SCHEMA)
    # The schema compiles once (then it is cached): timed apart, outside the decode runs.
    t = time.perf_counter()
    engine.grammar.submit("json", json.dumps(SCHEMA)).future.result()
    compile_s = time.perf_counter() - t
    timed(engine, prompts[:2], SamplingParams(max_new_tokens=8, temperature=0))  # warm-up both paths
    timed(engine, prompts[:2], SamplingParams(max_new_tokens=8, temperature=0, json_schema=SCHEMA))

    # The same work on both sides: each unconstrained request generates exactly as many tokens as its
    # constrained twin did (ignore_eos), so batch occupancy and context lengths match step for step.
    plain_runs, cons_runs, outs = [], [], []
    engine.grammar.reset_stats()
    for _ in range(args.repeats):
        s, outs = timed(engine, prompts, constrained)
        cons_runs.append(sum(x.completion_tokens for x in outs) / s)
        matched = [SamplingParams(max_new_tokens=x.completion_tokens, temperature=0, ignore_eos=True)
                   for x in outs]
        s, o = timed(engine, prompts, matched)
        plain_runs.append(sum(x.completion_tokens for x in o) / s)
    mask = engine.grammar.stats
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    p, c = statistics.median(plain_runs), statistics.median(cons_runs)
    overhead = (p / c - 1.0) * 100.0
    result = {
        "benchmark": "structured", "model": args.model, "device": args.device, "dtype": args.dtype,
        "batch": args.batch, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "unconstrained_tok_s": p, "constrained_tok_s": c, "overhead_pct": overhead,
        "mask_us_mean": mask["mean_us"], "mask_us_p99": mask["p99_us"], "mask_rows": mask["rows"],
        "schema_compile_s": compile_s, "constrained_valid": valid, "constrained_total": len(outs),
        "unconstrained_runs": plain_runs, "constrained_runs": cons_runs,
    }
    print(f"unconstrained {p:.1f} tok/s | json-schema {c:.1f} tok/s | overhead {overhead:.1f}% | "
          f"mask per token mean {mask['mean_us']:.0f} us, p99 {mask['p99_us']:.0f} us | "
          f"valid {valid}/{len(outs)} | schema compile {compile_s * 1e3:.0f} ms")
    out = Path(args.out or Path(__file__).parent / "results" / f"structured_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
