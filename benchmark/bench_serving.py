"""Serving: a Poisson request-rate sweep against `deepinfer serve` on loopback, beside the in-process Engine on
the same prompts (the ceiling the server path can reach), in one run.

    python benchmark/bench_serving.py [--num-requests 32] [--max-tokens 16] [--rates 1,2,4,inf] [--threads 1]

Every request streams (SSE, /v1/completions) exactly --max-tokens tokens (ignore_eos), so all modes do the same
work. The in-process figure is Engine.generate of all prompts in one call (the most batching possible); each
server rate sends the same prompts with exponential gaps (seeded; rate inf sends all at once), the prefix cache
flushed before each rate. The in-process figure is measured before and after the sweep (this machine's load
drifts; both are kept, their mean is the reference). Per rate: output tokens/s and its ratio to it, request
throughput, TTFT, inter-token latency (gaps between streamed chunks) and end-to-end latency percentiles.
Client, server and scheduler processes share this machine's cores. Writes benchmark/results/serving_<device>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river stone light window garden market winter letter music paper forest engine silver doctor "
         "island animal morning village bridge history summer teacher planet castle ocean").split()


def make_prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: write about " + " ".join(rng.choices(WORDS, k=rng.randint(8, 40))) + "."
            for i in range(num)]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    arr = np.asarray(values) * 1000.0
    return {f"p{q}_ms": float(np.percentile(arr, q)) for q in (50, 90, 99)} | {"mean_ms": float(arr.mean())}


def in_process(args, prompts: list[str]) -> dict:
    from deepinfer_rt import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with Engine(args.model, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                max_num_seqs=args.max_num_seqs) as engine:
        engine.generate(prompts[:2], sampling_params=params)  # warm-up
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(prompts, sampling_params=params)
        wall = time.perf_counter() - start
    num_tokens = sum(o.completion_tokens for o in outs)
    return {"wall_s": wall, "output_tokens": num_tokens, "output_tok_s": num_tokens / wall,
            "prompt_tokens": sum(o.prompt_tokens for o in outs)}


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deepinfer_rt.cli", "serve", "--model", args.model, "--port", str(port),
           "--dtype", args.dtype, "--kv-cache-tokens", str(args.kv_cache_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--max-queued-requests", str(args.num_requests)]
    env = {**os.environ, "DEEPINFER_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times, num_tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    return {"sent": sent, "chunks": chunk_times, "tokens": num_tokens}


async def sweep_rate(url: str, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, model, p, max_tokens, d)
                                         for p, d in zip(prompts, delays)))
        wall = time.perf_counter() - start
    num_tokens = sum(r["tokens"] for r in results)
    return {"rate_req_s": rate if rate != float("inf") else "inf", "wall_s": wall, "output_tokens": num_tokens,
            "output_tok_s": num_tokens / wall, "request_throughput_req_s": len(results) / wall,
            "ttft": percentiles([r["chunks"][0] - r["sent"] for r in results if r["chunks"]]),
            "itl": percentiles([b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]),
            "e2e": percentiles([r["chunks"][-1] - r["sent"] for r in results if r["chunks"]])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rates", default="1,2,4,inf", help="request rates (req/s) of the sweep")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine, in both modes")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_requests, args.seed)

    before = in_process(args, prompts)
    print(f"in-process Engine.generate: {before['output_tok_s']:.1f} output tok/s ({before['wall_s']:.2f} s)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    sweep = []
    try:
        asyncio.run(sweep_rate(url, args.model, prompts[:2], float("inf"), 2, args.seed))  # warm-up
        for rate in (float(r) for r in args.rates.split(",")):
            httpx.post(f"{url}/flush_cache", timeout=60)
            result = asyncio.run(sweep_rate(url, args.model, prompts, rate, args.max_tokens, args.seed))
            sweep.append(result)
            print(f"rate {rate:>5} req/s: {result['output_tok_s']:7.1f} tok/s, "
                  f"TTFT p50 {result['ttft'].get('p50_ms', 0):.0f} ms p99 {result['ttft'].get('p99_ms', 0):.0f} ms, "
                  f"ITL p50 {result['itl'].get('p50_ms', 0):.0f} ms p99 {result['itl'].get('p99_ms', 0):.0f} ms")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    after = in_process(args, prompts)
    reference = (before["output_tok_s"] + after["output_tok_s"]) / 2
    print(f"in-process Engine.generate again: {after['output_tok_s']:.1f} output tok/s; reference {reference:.1f}")
    for result in sweep:
        result["ratio_to_in_process"] = result["output_tok_s"] / reference
        print(f"rate {result['rate_req_s']:>5} req/s: {result['ratio_to_in_process']:.2f}x in-process")

    result = {"benchmark": "serving", "model": args.model, "device": "cpu", "dtype": args.dtype,
              "num_requests": args.num_requests, "max_tokens": args.max_tokens, "threads": args.threads,
              "max_num_seqs": args.max_num_seqs, "torch": torch.__version__, "machine": platform.machine(),
              "num_cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
              "in_process": {"before": before, "after": after, "reference_tok_s": reference},
              "sweep": sweep}
    out = ROOT / "benchmark" / "results" / "serving_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
