"""Host (Python) cost of an engine decode step, beside the model forward of the same steps.

B requests with `context`-token random prompts are prefilled, then `steps` greedy decode steps are timed one
by one. In the same run the model's own work is timed: on CPU the model forward + LM head calls (wrapped,
synchronous); on CUDA the replay of the step's CUDA graph + LM head + argmax, by CUDA events. The eager
non-graph path's input building (`ModelRunner.build`: tensors + attention metadata) is reported on its own:
on CPU it is the reference backend's O(context) gather, which CUDA graphs do not run.

    host per step  = median engine step - model forward per step   (CPU: thread CPU time; CUDA: wall time)
    per request    = host per step / B  (also without the eager build: the GPU decode path replays graphs)
With overlap scheduling on CUDA the host work of a step runs while the GPU computes the previous one, so the
exposed host time (step - forward) is what is left of it; the CPU run (synchronous model) shows all of it.

    python benchmark/bench_host.py                       # CPU, tiny DeepSeek-V2 shape, overlap off and on
    python benchmark/bench_host.py --device cuda --model deepseek-v2-lite --context 2048 \
        --out benchmark/results/host_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import PREFILL_CHUNK, SMOLLM2, TINY, V2_LITE, _cuda_time, model_dir

from deepinfer_rt import Engine, SamplingParams

SPECS = {"tiny": TINY, "deepseek-v2-lite": V2_LITE, "smollm2-135m": SMOLLM2}


class _Timer:
    """Accumulates seconds of wrapped callables on `clock`.

    CPU: the main thread's CPU time (with DEEPINFER_NUM_THREADS=1 torch computes on that thread), which other
    processes sharing the cores do not inflate as they do wall time. CUDA: wall time, which overlap changes."""

    def __init__(self, device: str):
        self.seconds = {"forward": 0.0, "build": 0.0}
        self.clock = time.perf_counter if device == "cuda" else time.thread_time

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = self.clock()
            out = fn(*args, **kwargs)
            self.seconds[key] += self.clock() - t0
            return out

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _graph_step_s(engine: Engine, batch: int) -> float | None:
    """Median GPU seconds of one decode step of `batch` rows: graph replay + LM head + argmax (CUDA events)."""
    graphs = engine.executor.graphs
    bs = None if graphs is None else next((b for b in graphs.batch_sizes if b >= batch), None)
    if bs is None:
        return None
    return _cuda_time(lambda: graphs.replay_step(bs), 20)


def _prefill_steps(batch: int, context: int) -> int:
    return -(-batch * context // PREFILL_CHUNK)


def bench_batch(engine: Engine, timer: _Timer, batch: int, context: int, steps: int, vocab: int,
                device: str, profile: bool) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, context), generator=g).tolist()
    # Long enough that the first prompts prefilled are still decoding when the last ones start: every timed
    # step decodes all B requests.
    params = SamplingParams(max_new_tokens=steps + 4 + _prefill_steps(batch, context), temperature=0.0,
                            ignore_eos=True)
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    while not all(r.num_output_tokens >= 2 for r in reqs):  # prefill, then one decode step to warm up
        engine.step()
    _sync(device)
    assert len(engine.scheduler.running) == batch, "the timed steps must decode the whole batch"
    prof = cProfile.Profile() if profile else None
    times, forwards, builds = [], [], []
    for _ in range(steps):
        timer.reset()
        t0 = timer.clock()
        if prof is not None:
            prof.enable()
        engine.step()
        if prof is not None:
            prof.disable()
        times.append(timer.clock() - t0)
        forwards.append(timer.seconds["forward"])
        builds.append(timer.seconds["build"])
    _sync(device)  # not per step: that would stop the next step's host work overlapping this one's GPU work
    assert len(engine.scheduler.running) == batch
    engine.abort(reqs)
    _sync(device)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    step_s = statistics.median(times)
    graph_s = _graph_step_s(engine, batch) if device == "cuda" else None
    if graph_s is not None:
        forward_s, host_s = graph_s, max(step_s - graph_s, 0.0)
    else:
        forward_s = statistics.median(forwards)
        host_s = statistics.median(t - f for t, f in zip(times, forwards))
    return {"batch": batch, "context": context, "steps": steps, "step_ms": step_s * 1e3,
            "step_spread_ms": [min(times) * 1e3, max(times) * 1e3], "forward_ms": forward_s * 1e3,
            "eager_build_ms": statistics.median(builds) * 1e3, "host_ms_per_step": host_s * 1e3,
            "host_us_per_req_step": host_s / batch * 1e6, "forward_fraction_of_step": forward_s / step_s,
            "host_excl_eager_build_us_per_req_step": (host_s - statistics.median(builds)) / batch * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=sorted(SPECS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--overlap", nargs="+", default=["off", "on"], choices=["off", "on"],
                        help="scheduling modes, interleaved per batch size on one engine")
    parser.add_argument("--profile", action="store_true", help="print the top functions of the timed steps")
    parser.add_argument("--out", default=None, help="default benchmark/results/host_<device>.json")
    args = parser.parse_args()
    # A long context on a short-context shape (SmolLM2: 8K) raises its position limit, as bench_gpu does.
    spec = dict(SPECS[args.model])
    spec["max_position_embeddings"] = max(spec["max_position_embeddings"], args.context + 4096)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the model computes on the timed thread (see _Timer)
    path = model_dir(spec, Path(tempfile.mkdtemp(prefix="bench-host-")))
    max_bs = max(args.batches)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    per_req = args.context + args.steps + _prefill_steps(max_bs, args.context) + 64
    engine = Engine(str(path), dtype=dtype, device=args.device, load_format="dummy", max_num_seqs=max_bs,
                    kv_cache_tokens=max_bs * per_req, chunked_prefill_tokens=PREFILL_CHUNK)
    timer = _Timer(args.device)
    timer.wrap(engine.model, "forward", "forward")
    timer.wrap(engine.model, "compute_logits", "forward")
    timer.wrap(engine.executor, "build", "build")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "model": args.model, "torch": torch.__version__, "args": vars(args),
              "clock": "wall" if args.device == "cuda" else "main-thread CPU time",
              "cpu_load_before": os.getloadavg(), "rows": []}
    try:
        for batch in args.batches:
            for mode in args.overlap:
                # Between batches nothing is in flight, so the mode can change on the one engine.
                engine.executor.is_overlap_enabled = mode == "on"
                with engine.hold_loop():  # this thread steps the engine: each timed step is one loop turn
                    row = bench_batch(engine, timer, batch, args.context, args.steps, spec["vocab_size"],
                                      args.device, args.profile)
                row["overlap"] = mode
                result["rows"].append(row)
                print(f"B={batch:4d} overlap {mode:3s} step {row['step_ms']:8.2f} ms  forward "
                      f"{row['forward_ms']:8.2f} ms  (eager build {row['eager_build_ms']:6.2f})  host "
                      f"{row['host_ms_per_step']:8.2f} ms/step  {row['host_us_per_req_step']:7.1f} us/req/step "
                      f"({row['host_excl_eager_build_us_per_req_step']:6.1f} without the eager build)",
                      flush=True)
    finally:
        engine.shutdown()
    result["cpu_load_after"] = os.getloadavg()
    out = Path(args.out or f"benchmark/results/host_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
