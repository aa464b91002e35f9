"""Concurrent callers against one call, same prompts, same engine, one run:

    python benchmark/bench_concurrency.py [--num-prompts 12] [--max-new-tokens 32] [--repeats 3]

  one call   engine.generate(all N prompts)                    the reference
  threads    N threads, one generate(prompt) each
  asyncio    N async_generate tasks under asyncio.gather
  run_batch  a deepinfer_lang program over the N prompts (run_batch's thread pool)
  extract    examples/extract_json.py's program over its dataset, against the same prompts in one generate

Each mode reports wall time (median of the repeats, with the spread), engine steps, the mean running batch per
step (requests in each launched batch), and its ratio to the one-call reference. The goals: threads and asyncio
within 1.2x of one call, the extraction job within 1.3x. Greedy; tokens are compared with the one call's.
Writes benchmark/results/concurrency_<device>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import deepinfer_lang as sgl  # noqa: E402
from deepinfer_rt import Engine, SamplingParams  # noqa: E402

TOPICS = ["the ocean", "a robot", "the moon", "coffee", "a lighthouse", "winter", "a library", "mountains",
          "a violin", "the desert", "a train journey", "gardening", "a thunderstorm", "old maps", "bees", "glass"]


class BatchRecorder:
    """Counts the requests of every batch the executor launches."""

    def __init__(self, engine: Engine):
        self.sizes: list[int] = []
        launch = engine.executor.launch

        def recorded(batch, prev=None):
            self.sizes.append(len(batch.items))
            return launch(batch, prev)
        engine.executor.launch = recorded

    def take(self) -> list[int]:
        sizes, self.sizes = self.sizes, []
        return sizes


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def one_call(engine, prompts, params):
    return [o.token_ids for o in engine.generate(prompts, sampling_params=params)]


def threads(engine, prompts, params):
    out = [None] * len(prompts)

    def call(i):
        out[i] = engine.generate([prompts[i]], sampling_params=params)[0].token_ids
    pool = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return out


def tasks(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.async_generate([p], sampling_params=params) for p in prompts])
    return [o[0].token_ids for o in asyncio.run(main())]


def run_batch(runtime, prompts, max_new_tokens):
    @sgl.function
    def program(s, prompt):
        s += prompt
        s += sgl.gen("out", max_tokens=max_new_tokens, temperature=0, ignore_eos=True)

    states = program.run_batch([{"prompt": p} for p in prompts], backend=runtime, num_threads=len(prompts))
    return [runtime.engine.tokenizer.encode(s["out"], add_special_tokens=False) for s in states]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = [f"Write one sentence about {TOPICS[i % len(TOPICS)]}." for i in range(args.num_prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    runtime = sgl.Runtime(model=args.model, dtype=args.dtype, enable_prefix_cache=False)
    engine = runtime.engine
    recorder = BatchRecorder(engine)
    modes = {"one_call": lambda: one_call(engine, prompts, params),
             "threads": lambda: threads(engine, prompts, params),
             "asyncio": lambda: tasks(engine, prompts, params),
             "run_batch": lambda: run_batch(runtime, prompts, args.max_new_tokens)}
    one_call(engine, prompts[:2], params)  # warm-up
    recorder.take()
    samples = {m: [] for m in modes}
    rows, ref_tokens = {}, None
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every mode alike
        for mode, fn in modes.items():
            steps0 = engine.num_steps
            seconds, tokens = timed(fn)
            sizes = recorder.take()
            samples[mode].append((seconds, engine.num_steps - steps0, sizes, tokens))
    for mode, runs in samples.items():
        secs = [s for s, *_ in runs]
        sizes = [n for _, _, sz, _ in runs for n in sz]
        tokens = runs[-1][3]
        if mode == "one_call":
            ref_tokens = tokens
        rows[mode] = {"wall_s_median": statistics.median(secs), "wall_s_min": min(secs), "wall_s_max": max(secs),
                      "steps_median": statistics.median(s for _, s, _, _ in runs),
                      "mean_running_batch": sum(sizes) / max(len(sizes), 1)}
        if mode in ("threads", "asyncio"):
            rows[mode]["same_tokens_as_one_call"] = tokens == ref_tokens
    for mode, row in rows.items():
        row["ratio_to_one_call"] = row["wall_s_median"] / rows["one_call"]["wall_s_median"]

    # The README's main job: examples/extract_json.py's program against the same chat prompts in one call.
    import extract_json

    data = [json.loads(line) for line in (ROOT / "examples/data/people.jsonl").read_text().splitlines() if line]
    texts = [{"text": r["text"]} for r in data]

    def extract_job():
        return extract_json.extract.run_batch(texts, backend=runtime, progress_bar=False)

    captured, generate = [], engine.generate

    def capturing(*a, input_ids=None, sampling_params=None, **kw):
        captured.extend(input_ids or [])
        return generate(*a, input_ids=input_ids, sampling_params=sampling_params, **kw)
    engine.generate = capturing
    extract_job()  # warm-up: compiles the grammar, records the prompts the program sends
    engine.generate = generate
    sp = SamplingParams(max_new_tokens=96, temperature=0.0, json_schema=extract_json.SCHEMA)
    job, single = [], []
    for _ in range(args.repeats):
        job.append(timed(extract_job)[0])
        single.append(timed(lambda: engine.generate(input_ids=captured, sampling_params=sp))[0])
    rows["extract_json"] = {"wall_s_median": statistics.median(job), "one_call_wall_s_median":
                            statistics.median(single), "ratio_to_one_call": statistics.median(job) /
                            statistics.median(single), "num_prompts": len(captured)}
    runtime.shutdown()
    result = {"model": args.model, "dtype": args.dtype, "device": "cpu", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "num_prompts": args.num_prompts,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "modes": rows,
              "goals": {"threads": 1.2, "asyncio": 1.2, "extract_json": 1.3}}
    for mode, row in rows.items():
        print(f"{mode:12s} {row['wall_s_median']:7.2f} s  x{row['ratio_to_one_call']:.2f} of one call"
              + (f"  steps {row['steps_median']:.0f}  mean batch {row['mean_running_batch']:.1f}"
                 if "steps_median" in row else f"  (one call {row['one_call_wall_s_median']:.2f} s)"))
    out = ROOT / "benchmark" / "results" / "concurrency_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
