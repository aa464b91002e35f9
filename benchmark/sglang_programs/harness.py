"""Runs one ported program two ways on the same model and reports both:

ours          the program through Program.run_batch on an engine with the prefix cache (forks, prefix prefill
              and the engine's batching as deepinfer_lang does them);
independent   every model call each program made (each gen, each select's scoring request, as the same
              prompt ids and sampling params) sent again as its own Engine.generate request to an engine
              without a prefix cache: a program's calls one after another, as a client without the frontend
              issues them (fork branches included), programs side by side on as many client threads as
              run_batch used.

Figures: wall time, programs/s, output tokens/s, model calls, and the prefix-cache hit rate of our run (cached /
prompt tokens of its engine requests, from engine.stats). A program module defines `program` (an
@sgl.function), `load(num_items) -> list[dict]` (its arguments; keys starting with "_" are for score only), NAME, and optionally `score(states, items) -> dict`.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import deepinfer_lang as sgl
from deepinfer_lang.interpreter import current_program_id
from deepinfer_rt import Engine

DATA = Path(__file__).resolve().parent / "data"


def read_jsonl(name: str, num_items: int | None = None) -> list[dict]:
    items = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]
    return items[:num_items] if num_items else items


class RecordingEngine:
    """An Engine seen through a recorder: every generate call's (input ids, sampling params, output)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.calls: list[tuple[str, list[int], object, object]] = []  # (program id, ids, params, outputs)
        self._lock = threading.Lock()
        self.is_prefill = threading.local()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompts=None, input_ids=None, sampling_params=None):
        outs = self._engine.generate(prompts=prompts, input_ids=input_ids, sampling_params=sampling_params)
        if not getattr(self.is_prefill, "value", False):
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
            n = [p.n for p in params]
            k = 0
            program_id = current_program_id()
            with self._lock:
                for ids, p, count in zip(input_ids, params, n):
                    self.calls.append((program_id, list(ids), p, outs[k:k + count]))
                    k += count
        return outs


class RecordingBackend(sgl.RuntimeBackend):
    """Our prefix prefills are part of our run, not calls the baseline repeats."""

    def cache_prefix(self, ids):
        self.engine.is_prefill.value = True
        try:
            return super().cache_prefix(ids)
        finally:
            self.engine.is_prefill.value = False


def _cache_counts(engine: Engine) -> tuple[int, int]:
    stats = engine.stats
    return stats.get("num_hit_tokens", 0), stats.get("num_query_tokens", 0)


def run_ours(module, engine: Engine, items: list[dict], num_threads) -> tuple[dict, list, list]:
    recorder = RecordingEngine(engine)
    backend = RecordingBackend(recorder)
    engine.flush_cache()
    hits0, queries0 = _cache_counts(engine)
    start = time.perf_counter()
    args = [{k: v for k, v in item.items() if not k.startswith("_")} for item in items]  # "_label": for score
    states = module.program.run_batch(args, backend=backend, num_threads=num_threads, temperature=0,
                                      **getattr(module, "RUN_ARGS", {}))
    elapsed = time.perf_counter() - start
    errors = [st.error() for st in states if st.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} programs failed; first: {errors[0]!r}") from errors[0]
    hits, queries = _cache_counts(engine)
    out_tokens = sum(o.completion_tokens for *_, outs in recorder.calls for o in outs)
    report = {"seconds": elapsed, "programs_per_s": len(items) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
              "model_calls": len(recorder.calls), "output_tokens": out_tokens,
              "cache_hit_rate": (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0}
    return report, states, recorder.calls


def run_independent(engine: Engine, calls: list, num_items: int, num_threads: int) -> dict:
    """Each recorded call as its own generate request (same ids and params): a program's calls in order, programs
    on num_threads client threads."""
    by_program: dict[str, list] = {}
    for program_id, ids, params, _ in calls:
        by_program.setdefault(program_id, []).append((ids, params))
    start = time.perf_counter()

    def one_program(program_calls):
        return [o for ids, params in program_calls for o in engine.generate(input_ids=[ids], sampling_params=params)]

    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        outs = [o for group in pool.map(one_program, by_program.values()) for o in group]
    elapsed = time.perf_counter() - start
    out_tokens = sum(o.completion_tokens for o in outs)
    return {"seconds": elapsed, "programs_per_s": num_items / elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "model_calls": len(calls), "output_tokens": out_tokens}


def run_benchmark(module, engine: Engine, baseline_engine: Engine | None, num_items: int | None = None,
                  num_threads: int | None = None) -> dict:
    items = module.load(num_items)
    threads = num_threads or min(len(items) * 4, engine.config.scheduler.max_num_seqs)
    ours, states, calls = run_ours(module, engine, items, threads)
    report = {"program": getattr(module, "NAME", module.__name__.rsplit(".", 1)[-1]), "num_programs": len(items), "ours": ours}
    if hasattr(module, "score"):
        report["metrics"] = module.score(states, items)
    if baseline_engine is not None:
        report["independent"] = run_independent(baseline_engine, calls, len(items), threads)
        report["speedup"] = report["independent"]["seconds"] / ours["seconds"]
    return report


def format_report(r: dict) -> str:
    o = r["ours"]
    line = (f"{r['program']:>18}: {r['num_programs']} programs, {o['model_calls']} model calls | ours "
            f"{o['programs_per_s']:.2f} programs/s, {o['output_tokens_per_s']:.1f} out tok/s, cache hit rate "
            f"{o['cache_hit_rate']:.1%}")
    if "independent" in r:
        i = r["independent"]
        line += (f" | independent generate {i['programs_per_s']:.2f} programs/s, {i['output_tokens_per_s']:.1f} "
                 f"out tok/s | speedup {r['speedup']:.2f}x")
    if r.get("metrics"):
        line += " | " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in r["metrics"].items())
    return line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-items", type=int, default=None, help="items of the dataset (default: all)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--no-baseline", action="store_true", help="skip the independent-generate run")
    parser.add_argument("--json", default=None, help="also write the reports to this file")
    return parser.parse_args(argv)


def make_engines(args) -> tuple[Engine, Engine | None]:
    engine = Engine(args.model, dtype=args.dtype)
    baseline = None if args.no_baseline else Engine(args.model, dtype=args.dtype, enable_prefix_cache=False)
    return engine, baseline


def main(modules: list, argv=None) -> list[dict]:
    args = parse_args(argv)
    engine, baseline = make_engines(args)
    reports = []
    try:
        for module in modules:
            report = run_benchmark(module, engine, baseline, args.num_items, args.num_threads)
            print(format_report(report), flush=True)
            reports.append(report)
    finally:
        engine.shutdown()
        if baseline is not None:
            baseline.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))
    return reports
