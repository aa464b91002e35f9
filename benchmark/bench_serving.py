"""Serving: a Poisson request-rate sweep against `deepinfer serve` on loopback, beside the in-process Engine on
the same prompts (the ceiling the server path can reach), in one run.

    python benchmark/bench_serving.py [--num-requests 32] [--max-tokens 16] [--rates 1,2,4,inf] [--threads 1]
    python benchmark/bench_serving.py --mode mixed [--num-requests 32] [--max-tokens 16] [--mixed-rate 8]

Every request streams (SSE, /v1/completions) exactly --max-tokens tokens (ignore_eos), so all modes do the same
work. The in-process figure is Engine.generate of all prompts in one call (the most batching possible); each
server rate sends the same prompts with exponential gaps (seeded; rate inf sends all at once), the prefix cache
flushed before each rate. The in-process figure is measured before and after the sweep (this machine's load
drifts; both are kept, their mean is the reference). Per rate: output tokens/s and its ratio to it, request
throughput, TTFT, inter-token latency (gaps between streamed chunks) and end-to-end latency percentiles.
Client, server and scheduler processes share this machine's cores. Writes benchmark/results/serving_<device>.json.

--mode mixed: robustness under abuse, compared in one run against one server. The same good requests (Poisson at
--mixed-rate) run clean, then mixed with 5% malformed requests (wrong types, a 450-deep schema, a huge top_k,
lone surrogates, an oversized body) and 10% streams that disconnect after their first chunk, then clean again
(the two clean runs bracket the mixed one against load drift). Reported: the good requests' output tok/s and
p99 end-to-end latency mixed vs clean (goal: within 10%), every good request complete (none lost), every
malformed one a 4xx, and afterwards nothing admitted, running or holding KV (none leaked). Writes
benchmark/results/serving_mixed_<device>.json.
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


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL to its process group if it has not exited within 30 s."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


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


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def malformed_bodies(model: str) -> list[tuple[str, bytes]]:
    """(route, raw body) of requests a fuzzer found harmful before the server was hardened."""
    def raw(body) -> bytes:
        return json.dumps(body).encode()

    return [
        ("/generate", raw({"text": "Hi", "sampling_params": {"max_new_tokens": 4, "stop_token_ids": 5}})),
        ("/generate", raw({"text": "Hi", "sampling_params": {"n": 15, "json_schema": _deep_schema(450)}})),
        ("/v1/completions", raw({"model": model, "prompt": "Hi", "max_tokens": 4, "top_k": 10**30})),
        ("/v1/completions", raw({"model": model, "prompt": "Hi \ud800", "max_tokens": 4})),
        ("/v1/completions", raw({"model": model, "prompt": "Hi", "max_tokens": "16"})),
        ("/v1/chat/completions", raw({"model": model, "messages": [{"role": "user", "content": [{"type": "text"}]}]})),
        ("/v1/completions", b'{"model": "%s", "prompt": "' % model.encode() + b"a" * (17 << 20) + b'"}'),
    ]


async def bad_request(client: httpx.AsyncClient, route: str, body: bytes, delay: float) -> dict:
    await asyncio.sleep(delay)
    try:
        response = await client.post(route, content=body, headers={"content-type": "application/json"})
        return {"status": response.status_code}
    except httpx.HTTPError as e:  # an oversized body may be refused before it is all sent
        return {"status": 413 if "413" in str(e) else -1, "error": repr(e)}


async def disconnecting_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                                delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream
    return {"status": response.status_code}


async def mixed_phase(url: str, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int,
                      is_mixed: bool) -> dict:
    """The good requests at `rate`, with (is_mixed) 5% malformed and 10% disconnecting requests among them."""
    rng = random.Random(seed)
    num_total = round(len(prompts) / 0.85) if is_mixed else len(prompts)
    num_bad = max(1, round(num_total * 0.05)) if is_mixed else 0
    num_gone = num_total - len(prompts) - num_bad
    kinds = ["good"] * len(prompts) + ["bad"] * num_bad + ["gone"] * num_gone
    rng.shuffle(kinds)
    bad = malformed_bodies(model)
    limits = httpx.Limits(max_connections=num_total + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks, t, good_i, bad_i = [], 0.0, 0, 0
        for kind in kinds:
            if kind == "good":
                tasks.append(one_request(client, model, prompts[good_i], max_tokens, t))
                good_i += 1
            elif kind == "bad":
                tasks.append(bad_request(client, *bad[(bad_i + seed) % len(bad)], t))
                bad_i += 1
            else:
                tasks.append(disconnecting_request(client, model, rng.choice(prompts), max_tokens * 4, t))
            t += rng.expovariate(rate) if rate != float("inf") else 0.0
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    good = [r for k, r in zip(kinds, results) if k == "good"]
    bad_status = [r["status"] for k, r in zip(kinds, results) if k == "bad"]
    num_tokens = sum(r["tokens"] for r in good)
    return {"num_good": len(good), "num_malformed": num_bad, "num_disconnecting": num_gone, "wall_s": wall,
            "good_output_tok_s": num_tokens / wall,
            "num_good_lost": sum(r["tokens"] != max_tokens for r in good),
            "malformed_status": sorted(bad_status), "num_malformed_5xx": sum(s >= 500 or s < 0 for s in bad_status),
            "e2e": percentiles([r["chunks"][-1] - r["sent"] for r in good if r["chunks"]]),
            "ttft": percentiles([r["chunks"][0] - r["sent"] for r in good if r["chunks"]])}


def leak_check(url: str) -> dict:
    """Once idle: nothing admitted, running or waiting; every KV page free or in the prefix cache."""
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        idle = info["num_inflight_seqs"] == 0 and info["num_running"] == 0 and info["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {"num_inflight_seqs": info["num_inflight_seqs"], "num_running": info["num_running"],
            "num_waiting": info["num_waiting"],
            "num_pages_held": info["num_pages"] - info["num_free_pages"] - info["num_cached_pages"],
            "num_engine_restarts": info.get("num_engine_restarts", 0)}


def run_mixed(args, prompts: list[str], url: str) -> dict:
    phases = {}
    for name, is_mixed in (("clean_before", False), ("mixed", True), ("clean_after", False)):
        httpx.post(f"{url}/flush_cache", timeout=60)
        phases[name] = asyncio.run(mixed_phase(url, args.model, prompts, args.mixed_rate, args.max_tokens,
                                               args.seed, is_mixed))
        phases[name]["after"] = leak_check(url)
    clean_tok_s = (phases["clean_before"]["good_output_tok_s"] + phases["clean_after"]["good_output_tok_s"]) / 2
    clean_p99 = (phases["clean_before"]["e2e"]["p99_ms"] + phases["clean_after"]["e2e"]["p99_ms"]) / 2
    mixed = phases["mixed"]
    leaks = [p["after"] for p in phases.values()]
    summary = {"throughput_ratio": mixed["good_output_tok_s"] / clean_tok_s,
               "p99_e2e_ratio": mixed["e2e"]["p99_ms"] / clean_p99,
               "num_good_lost": sum(p["num_good_lost"] for p in phases.values()),
               "num_malformed_5xx": mixed["num_malformed_5xx"],
               "is_leak_free": all(a["num_inflight_seqs"] == a["num_running"] == a["num_waiting"]
                                   == a["num_pages_held"] == a["num_engine_restarts"] == 0 for a in leaks)}
    for name, p in phases.items():
        print(f"{name:>12}: good {p['good_output_tok_s']:7.1f} tok/s, e2e p50 {p['e2e']['p50_ms']:.0f} ms "
              f"p99 {p['e2e']['p99_ms']:.0f} ms, lost {p['num_good_lost']}, malformed {p['malformed_status']}, "
              f"after: {p['after']}")
    print(f"mixed vs clean: throughput {summary['throughput_ratio']:.3f}x, p99 e2e {summary['p99_e2e_ratio']:.3f}x "
          f"(goal: within 10%); lost {summary['num_good_lost']}, malformed 5xx {summary['num_malformed_5xx']}, "
          f"leak-free {summary['is_leak_free']}")
    return {"phases": phases, "summary": summary}


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
    ap.add_argument("--mode", choices=("sweep", "mixed"), default="sweep")
    ap.add_argument("--mixed-rate", type=float, default=8.0, help="request rate (req/s) of --mode mixed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_requests, args.seed)
    if args.mode == "mixed":
        return main_mixed(args, prompts)

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
        stop_server(server)
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


def main_mixed(args, prompts: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(sweep_rate(url, args.model, prompts[:2], float("inf"), 2, args.seed))  # warm-up
        mixed = run_mixed(args, prompts, url)
    finally:
        stop_server(server)
    result = {"benchmark": "serving_mixed", "model": args.model, "device": "cpu", "dtype": args.dtype,
              "num_good_requests": args.num_requests, "max_tokens": args.max_tokens, "rate_req_s": args.mixed_rate,
              "threads": args.threads, "max_num_seqs": args.max_num_seqs, "torch": torch.__version__,
              "machine": platform.machine(), "num_cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
              **mixed}
    out = ROOT / "benchmark" / "results" / "serving_mixed_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
