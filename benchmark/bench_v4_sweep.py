"""DeepSeek-V4 / V4.1 decode sweep on one GPU: V4-Flash- and V4.1-Flash-shaped models beside their decode floor.

For each variant (shape x weight format: v4-bf16, v4-fp8, v41-bf16, v41-fp8; benchmark/v4_sweep_shapes.py) in one
process on one GPU:
  ceilings   copy bandwidth, the bf16 matmul rate and the FP8 one (torch._scaled_mm), measured first;
  layers     as many as fit the device (meta-device builds: weights while drawn and while running, the KV pool
             of the largest batch at the longest context, `--reserve-gib`), or `--layers`;
  decode     per context, an engine (load_format="dummy", the compact KV pool; FP8 KV for v4-fp8 and v41-fp8) whose pool is
             filled with random state in place of a prefill -- decode cost does not depend on the values, and a
             prefill of 256 x 32K tokens would take the whole run. B requests are set at position context - 1 with
             their pages and recent rows held, then decode steps run through the engine's executor (the model
             runner: overlap, sampling at temperature 1 so hash routing sees varied tokens) as the engine loop
             runs them, eagerly and through CUDA graphs (DEEPINFER_V4_CUDA_GRAPHS=1, the default, and =0):
             tok/s per GPU = B / wall time per step, tok/s per user = 1 / wall time per step; graphed rows also
             give the replayed step's GPU time (graph + LM head + argmax, CUDA events);
  floor      bytes a step must read (v4_sweep_shapes.py) over the copy bandwidth; routed experts at the fewer of
             the expected count and the count the step's routers touched (hooked on the eager steps). A figure
             above the floor fails the run;
  KV         bytes per token of the full V4-Flash / V4.1-Flash configs (compact pool, bf16 and FP8) beside
             SGLang's 7,705 (V4, FP8) and TensorRT-LLM's 890 + 528 per layer of window (V4.1), and the largest
             context one GPU holds next to the benchmarked weights (free memory / pool bytes per token);
  prefill    `--prefill-seqs` prompts of `--prefill-tokens`, FLOP/s over the matmul rate of the weights' format;
  sweep      per variant, context and mode: throughput per GPU against tokens/s per user over the batches, in the
             JSON (`sweep`) and a PNG beside it (matplotlib, if installed).

    python benchmark/bench_v4_sweep.py --out benchmark/results/v4_sweep_h200.json
    python benchmark/bench_v4_sweep.py --smoke --out /tmp/v4_sweep_smoke.json     # CPU: tiny widths, the logic
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "scripts")]
import v4_sweep_shapes as shapes  # noqa: E402
from plot_v4_sweep import build_sweep, plot  # noqa: E402

from v4_sweep_decode import cuda_time, decode_steps, fill_pool, new_requests, pool_tensor_bytes, release, \
    routing_counts  # noqa: E402

from bench_gpu import env_vars  # noqa: E402
from deepinfer_rt import Engine, SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = ("v4-bf16", "v4-fp8", "v41-bf16", "v41-fp8")


class MeasurementError(AssertionError):
    """A figure the benchmark cannot stand behind (above the floor, or a replay that is not the real step)."""


def check_floor(row: dict) -> None:
    """Raise for a decode figure above its floor: impossible, so a bug in the benchmark or in the floor."""
    for key in ("tok_s", "gpu_tok_s"):
        if key in row and row[key] > row["floor_tok_s"]:
            raise MeasurementError(f"{row.get('variant')} {row.get('mode')} batch {row['batch']}, context "
                                   f"{row['context']}: {key} {row[key]:.1f} is above the floor "
                                   f"{row['floor_tok_s']:.1f}")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ceilings() -> dict:
    if DEVICE != "cuda":
        return {"copy_bytes_per_s": 1e10, "bf16_matmul_flop_per_s": 1e12, "fp8_matmul_flop_per_s": 2e12}
    import bench_fp8
    import bench_gpu

    ceil = bench_gpu.ceilings()
    ceil["fp8_matmul_flop_per_s"] = bench_fp8.fp8_matmul_rate()
    torch.cuda.empty_cache()  # the free memory the layer fit reads must not count the cached test tensors
    return ceil


def device_free_bytes(args) -> float:
    return torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else args.device_gib * 2**30


# ---- the variant's model ----

class Variant:
    """One shape x format: its config folders, layer count, floors' inputs."""

    def __init__(self, name: str, args, work: Path):
        self.name = name
        self.shape, self.fmt = name.split("-")
        self.args, self.work = args, work
        self.kv_cache_dtype = "fp8_e4m3" if self.fmt == "fp8" and not args.bf16_kv else "auto"
        self.dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
        self.max_position = max(args.contexts) + 1024

    def path(self, layers: int, fmt: str | None = None, tag: str = "", max_position: int | None = None) -> Path:
        """The model folder; `max_position` (default: the longest context) also bounds the CUDA graphs' page table
        width, which sets how many entry slots a graphed step scans: one folder per context."""
        raw = shapes.raw_config(self.shape, fmt or self.fmt, layers, self.args.experts,
                                max_position or self.max_position, self.args.smoke)
        return shapes.write_model_dir(raw, self.work / f"{self.name}-{layers}{tag}")

    def tokens_per_seq(self, context: int, page_size: int) -> int:
        decode = 2 * (self.args.warmup + self.args.steps) + 2
        return -(-(context + decode) // page_size) * page_size + page_size

    def recent_fraction(self, layout, batch: int, context: int, page_size: int) -> float:
        """Recent rows for what `batch` sequences hold at once (R + the release margin + the decode steps +
        pinned checkpoints, in pages), as a share of the main pool."""
        pages = -(-(layout.recent_tokens + layout.release_margin + 2 * (self.args.warmup + self.args.steps)) //
                  page_size) + 4
        return min(1.0, 2 * batch * pages / (batch * self.tokens_per_seq(context, page_size) // page_size))

    def plan(self, layers: int) -> dict:
        """Memory of an N-layer build (meta device): fits when both the draw and the run fit the free memory."""
        config, model = shapes.meta_model(self.path(layers, tag="-meta"), torch.device(DEVICE))
        mem = shapes.weight_memory(model, config, self.dtype)
        layout = shapes.kv_layout(model, config, self.kv_cache_dtype)
        b, c = max(self.args.batches), max(self.args.contexts)
        ps = shapes.page_size_for(self.shape, config.raw)
        layout = _with_fraction(layout, self.recent_fraction(layout, b, c, ps))
        kv = shapes.pool_bytes(layout, b * self.tokens_per_seq(c, ps), ps, self.dtype)
        free, reserve = device_free_bytes(self.args), self.args.reserve_gib * 2**30
        fits = mem["build_bytes"] + mem["build_temp_bytes"] + 2**30 <= free and \
            mem["run_bytes"] + kv + reserve <= free
        return dict(layers=layers, fits=fits, kv_pool_bytes=kv, free_bytes=free, reserve_bytes=reserve, **mem)

    def fit_layers(self) -> tuple[int, list[dict]]:
        """The largest layer count that fits (bytes grow with the count: bisection over meta builds)."""
        lo, hi = 2 if self.shape == "v41" else 1, 40 if self.shape == "v41" else 43
        hi = min(hi, self.args.max_layers or hi)
        plans = [self.plan(lo)]
        if not plans[0]["fits"]:
            raise ValueError(f"{self.name}: not even {lo} layers fit ({plans[0]})")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            plans.append(self.plan(mid))
            lo, hi = (mid, hi) if plans[-1]["fits"] else (lo, mid - 1)
        return lo, plans


def _with_fraction(layout, fraction: float):
    import dataclasses

    return dataclasses.replace(layout, recent_fraction=fraction)


def build_engine(variant: Variant, path: Path, context: int, graphs: bool) -> Engine:
    args = variant.args
    config, layout = shapes.layout_of(path, variant.kv_cache_dtype)
    ps = shapes.page_size_for(variant.shape, config.raw)
    b = max(args.batches)
    fraction = variant.recent_fraction(layout, b, context, ps)
    with env_vars(DEEPINFER_V4_CUDA_GRAPHS=int(graphs), DEEPINFER_V4_RECENT_FRACTION=fraction):
        return Engine(str(path), dtype="bfloat16" if DEVICE == "cuda" else "float32", device=DEVICE,
                      load_format="dummy", max_num_seqs=b, kv_cache_tokens=b * variant.tokens_per_seq(context, ps),
                      page_size=ps, chunked_prefill_tokens=args.prefill_tokens, enable_prefix_cache=False,
                      kv_cache_dtype=variant.kv_cache_dtype)


def attach_cpu_graphs(engine: Engine, batches: list[int]) -> None:
    """CPU smoke runs: the fixed-shape (CUDA-graph) decode steps, uncaptured, so the graphed path's logic runs."""
    from deepinfer_rt.cuda_graph import CudaGraphRunner

    runner = engine.executor
    graphs = CudaGraphRunner(engine.model, engine.pool, None, max(batches), engine.model_config.max_position,
                             batch_sizes=tuple(batches), num_rows=runner.pages.table.shape[0], is_captured=False)
    runner.graphs, runner.pages = graphs, graphs.pages


def bench_batch(engine: Engine, variant: Variant, floor_in: dict, batch: int, context: int, ceil: dict) -> list[dict]:
    """Eager rows then graphed rows (when the engine has graphs) of one batch at one context."""
    args, runner = variant.args, engine.executor
    graphs = runner.graphs
    reqs = new_requests(engine, batch, context, variant.tokens_per_seq(context, engine.pool.page_size))
    rows, touched = [], None
    try:
        for mode in ["eager"] + (["graphs"] if graphs is not None else []):
            runner.graphs = graphs if mode == "graphs" else None
            if mode == "eager":
                with routing_counts(engine.model) as counts:
                    decode_steps(runner, reqs, args.warmup)
                touched = {layer: min(c) for layer, c in counts.items()}
            else:
                decode_steps(runner, reqs, args.warmup)
            t0 = time.perf_counter()
            decode_steps(runner, reqs, 1)
            steps = max(1, min(args.steps - 1, int(args.row_budget_s / max(time.perf_counter() - t0, 1e-6))))
            replays0 = graphs.num_replays if graphs is not None else 0
            # One more step than timed: the clock starts as the first step's tokens arrive, when the next step
            # is already launched (an engine loop that keeps decoding); the first step's launch, with nothing
            # in flight to hide it, is left out (with few timed steps it added its host time / steps to each).
            collected = []
            t0 = time.perf_counter()
            decode_steps(runner, reqs, steps + 1, collected)
            cold_s = (time.perf_counter() - t0) / (steps + 1)
            seconds = (collected[-1] - collected[0]) / steps
            row = {"variant": variant.name, "mode": mode, "batch": batch, "context": context, "steps": steps,
                   "wall_ms_per_step": seconds * 1e3, "tok_s": batch / seconds, "tok_s_per_user": 1 / seconds,
                   "cold_wall_ms_per_step": cold_s * 1e3}
            if mode == "graphs":
                row.update(graph_steps=graphs.num_replays - replays0, is_captured=graphs.is_captured)
                if row["graph_steps"] != steps + 1:  # some steps ran eagerly: not a graphed figure
                    row["mode"] = "graphs-partial"
                else:
                    try:
                        graphs.check_covers(reqs)  # the replay below must read what the real step read
                    except AssertionError as e:
                        row["replay_error"] = str(e)
                is_replayable = row["mode"] == "graphs" and "replay_error" not in row and batch in graphs._graphs
                if graphs.is_captured and is_replayable:
                    def replay():
                        graphs.replay_step(batch)  # the graph, its logits and their argmax

                    step_s = cuda_time(replay, 10)
                    row.update(gpu_step_ms=step_s * 1e3, gpu_tok_s=batch / step_s)
                    if batch in args.profile_batches:
                        row["profile"] = kernel_table(replay)
            rows.append(row)
    finally:
        runner.graphs = graphs
        release(engine, reqs)
    e, k = engine.model_config.n_routed_experts, engine.model_config.num_experts_per_tok
    expected = shapes.expected_touched(e, k, batch)
    used = {layer: min(expected, touched.get(layer, expected)) for layer in floor_in["per_expert"]}
    floor = shapes.decode_floor(floor_in["always"], floor_in["per_expert"], used, floor_in["kv"][context], batch,
                                ceil["copy_bytes_per_s"])
    for row in rows:
        row.update(floor, expected_touched_experts=expected,
                   touched_experts_min=min(touched.values()) if touched else None,
                   kv_read_bytes_per_seq=floor_in["kv"][context], fraction_of_floor=row["tok_s"] / floor["floor_tok_s"])
        if "gpu_tok_s" in row:
            row["gpu_fraction_of_floor"] = row["gpu_tok_s"] / floor["floor_tok_s"]
    return rows


def kernel_table(fn) -> list[str] | str:
    """The top kernels of one call by GPU time (a graph replay's kernels are recorded one by one): where a step
    below its floor spends its time (`--profile-batches`)."""
    import bench_gpu

    return bench_gpu._profile(fn, rows=80)  # the step's many small kernels too, not only the top few


# ---- prefill, capacity ----

def bench_prefill(engine: Engine, variant: Variant, flop_model, ceil: dict) -> dict:
    args = variant.args
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(3):  # the first compiles and autotunes the prefill shapes; the median of the rest
        prompts = torch.randint(0, vocab, (args.prefill_seqs, args.prefill_tokens), generator=gen).tolist()
        _sync()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        _sync()
        runs.append(time.perf_counter() - t0)
    seconds = statistics.median(runs[1:])
    profile = kernel_table(lambda: engine.generate(input_ids=prompts, sampling_params=params)) \
        if args.profile_batches and DEVICE == "cuda" else None
    flops = shapes.prefill_flops(variant.shape, flop_model, engine.model_config, args.prefill_tokens,
                                 args.prefill_seqs)
    rate = ceil["fp8_matmul_flop_per_s" if variant.fmt == "fp8" else "bf16_matmul_flop_per_s"]
    row = {"num_seqs": args.prefill_seqs, "tokens": args.prefill_tokens, "run_seconds": runs,
           "tok_s": args.prefill_seqs * args.prefill_tokens / seconds, "flop_per_s": flops / seconds,
           "matmul_rate": rate, "fraction_of_matmul_rate": flops / seconds / rate}
    if profile is not None:
        row["profile"] = profile
    if row["fraction_of_matmul_rate"] > 1:
        raise MeasurementError(f"{variant.name} prefill: {row['fraction_of_matmul_rate']:.2f} of the matmul rate")
    return row


def capacity(engine: Engine, variant: Variant) -> dict:
    """The largest context the device holds beside these weights: the memory free for KV (free now plus this
    pool's own tensors, less the reserve) over the pool's bytes per token -- as the engine sizes its pool by
    default (DEEPINFER_V4_RECENT_FRACTION's default share of recent rows) and for one sequence (entries for every
    token, recent rows for R + the release margin, and R at every checkpoint)."""
    from deepinfer_rt.env import get_env

    pool = engine.pool
    free = device_free_bytes(variant.args) + (pool_tensor_bytes(pool) if DEVICE == "cuda" else 0)
    budget = free - variant.args.reserve_gib * 2**30
    layout = _with_fraction(pool.layout, get_env().v4_recent_fraction)
    dtype = variant.dtype
    long_lived, recent = layout.long_lived_bytes_per_token(dtype), layout.recent_bytes_per_token(dtype)
    r = layout.recent_tokens
    one = (budget - recent * (r + layout.release_margin)) / (long_lived + recent * r / layout.checkpoint_tokens)
    return {"free_kv_bytes": budget, "pool_bytes_per_token": layout.bytes_per_token(dtype),
            "long_lived_bytes_per_token": long_lived, "recent_bytes_per_token": recent,
            "pool_tokens": int(budget // layout.bytes_per_token(dtype)), "one_sequence_tokens": int(one)}


# ---- a variant ----

def run_variant(variant: Variant, ceil: dict, section: dict, save) -> None:
    args = variant.args
    if args.layers:
        layers, plans = args.layers, [variant.plan(args.layers)]
    else:
        layers, plans = variant.fit_layers()
    section.update(layers=layers, plans=plans, kv_cache_dtype=variant.kv_cache_dtype, decode=[])
    _, flop_model = shapes.meta_model(variant.path(layers, "bf16", "-flops"), torch.device("meta"))
    print(f"{variant.name}: {layers} layers, {plans[-1]['run_bytes'] / 2**30:.1f} GiB of weights (meta build)",
          flush=True)
    save()
    for context in args.contexts:
        path = variant.path(layers, tag=f"-ctx{context}", max_position=context + 1024)
        engine, section["graphs_error"] = None, section.get("graphs_error")
        if DEVICE == "cuda" and not args.no_graphs:
            try:
                engine = build_engine(variant, path, context, graphs=True)
            except Exception:  # graphs are opt-in until verified: the eager rows still count
                section["graphs_error"] = traceback.format_exc()[-2000:]
                print(section["graphs_error"], flush=True)
                gc.collect()
                torch.cuda.empty_cache()
        engine = engine or build_engine(variant, path, context, graphs=False)
        try:
            if DEVICE == "cpu" and not args.no_graphs:
                attach_cpu_graphs(engine, args.batches)
            always, per_expert = shapes.weight_split(engine.model, engine.model_config)
            kv = {context: shapes.attended_kv_bytes(variant.shape, engine.model_config, context,
                                                    variant.kv_cache_dtype == "fp8_e4m3")}
            floor_in = {"always": always, "per_expert": per_expert, "kv": kv}
            section.setdefault("weight_bytes", sum(p.numel() * p.element_size() for p in engine.model.parameters()))
            section.setdefault("capacity", capacity(engine, variant))
            section.setdefault("has_graphs", engine.executor.graphs is not None)
            fill_pool(engine.pool)
            for batch in args.batches:
                rows = bench_batch(engine, variant, floor_in, batch, context, ceil)
                section["decode"].extend(rows)
                save()
                for row in rows:
                    print(_line(row), flush=True)
                    check_floor(row)
            if context == args.contexts[0] and args.prefill_seqs:
                section["prefill"] = bench_prefill(engine, variant, flop_model, ceil)
                print(variant.name, "prefill", {k: v for k, v in section["prefill"].items() if k != "run_seconds"},
                      flush=True)
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        save()


def _line(row: dict) -> str:
    gpu = f"  gpu {row['gpu_tok_s']:9.1f} ({row['gpu_fraction_of_floor']:.2f})" if "gpu_tok_s" in row else ""
    return (f"{row['variant']:9s} {row['mode']:6s} ctx={row['context']:6d} B={row['batch']:4d} "
            f"{row['tok_s']:9.1f} tok/s ({row['tok_s_per_user']:7.1f}/user)  floor {row['floor_tok_s']:9.1f}  "
            f"frac {row['fraction_of_floor']:.2f}{gpu}  wall {row['wall_ms_per_step']:.2f} ms  "
            f"floor {row['floor_ms_per_step']:.2f} ms")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/v4_sweep_h200.json")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per row (at most)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before each row")
    parser.add_argument("--row-budget-s", type=float, default=4.0, help="fewer timed steps where a row would pass it")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--layers", type=int, help="this many layers instead of as many as fit")
    parser.add_argument("--max-layers", type=int, help="fit at most this many layers")
    parser.add_argument("--reserve-gib", type=float, default=16.0, help="memory kept for activations and graphs")
    parser.add_argument("--device-gib", type=float, default=139.0, help="CPU runs: the device memory to plan for")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--prefill-seqs", type=int, default=2, help="0: no prefill rows")
    parser.add_argument("--bf16-kv", action="store_true", help="v4-fp8 and v41-fp8 with a bf16 KV pool")
    parser.add_argument("--no-graphs", action="store_true", help="eager rows only")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--profile-batches", type=int, nargs="*", default=[],
                        help="graphed rows of these batches (and each prefill row) get a kernel table")
    parser.add_argument("--smoke", action="store_true", help="CPU check of the logic: tiny widths, layers, contexts")
    args = parser.parse_args(argv)
    if args.smoke:
        args.experts, args.layers = 8, args.layers or 4
        if "--contexts" not in (argv or sys.argv):
            args.contexts = [40, 72]
        if "--batches" not in (argv or sys.argv):
            args.batches = [1, 3]
        args.steps, args.warmup, args.prefill_tokens, args.prefill_seqs = 3, 1, 32, min(args.prefill_seqs, 1)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    ceil = ceilings()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)",
              "torch": torch.__version__, "command": " ".join(sys.argv), "args": vars(args), "ceilings": ceil,
              "full_kv": shapes.full_kv_report()}

    def save():
        result["sweep"] = build_sweep(result, args.variants)
        out.write_text(json.dumps(result, indent=1, default=float))

    print(ceil, flush=True)
    work = Path(tempfile.mkdtemp(prefix="v4sweep-"))
    for name in args.variants:
        section = result.setdefault(name, {})
        try:
            run_variant(Variant(name, args, work), ceil, section, save)
        except Exception:
            section["error"] = traceback.format_exc()[-3000:]
            print(section["error"], flush=True)
        save()
    for name in args.variants:
        for row in result[name].get("decode", []):
            print(_line(row))
        if "capacity" in result[name]:
            c = result[name]["capacity"]
            print(f"{name}: {result[name]['layers']} layers; KV {c['pool_bytes_per_token']} B/token in the pool "
                  f"-> {c['pool_tokens']} tokens, one sequence up to {c['one_sequence_tokens']} tokens")
    print(json.dumps(result["full_kv"]))
    if not args.no_plot:
        plot(result, str(out.with_suffix(".png")))
    failures = [f"{n}: {result[n]['error'].strip().splitlines()[-1]}" for n in args.variants
                if "MeasurementError" in result[n].get("error", "")]
    if failures:
        raise SystemExit("measurement check failed: " + "; ".join(failures))
    return result


if __name__ == "__main__":
    main()
