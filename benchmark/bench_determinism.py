"""Cost of batch-invariant mode: offline throughput with the switch off vs on, same prompts, in one run.

    python benchmark/bench_determinism.py [--num-prompts 16] [--max-new-tokens 32] [--repeats 3]
    python benchmark/bench_determinism.py --device cuda --dtype bfloat16 --dummy smollm2-135m
    python benchmark/bench_determinism.py --device cuda --dtype bfloat16 --dummy deepseek-v2-lite \
        --out benchmark/results/determinism_v2lite_h200.json

Two engines (mode off, mode on) take turns on the same prompts (greedy, fixed output length) so machine drift
hits both alike; each figure is the median over repeats. Also checks that the mode-on outputs match between
the batched run and each prompt run alone (the property the mode buys). `--dummy` builds a random-weight model
of that shape (benchmark/bench_gpu.py's specs, load_format="dummy"). On CUDA the run also times the
batch-invariant Triton matmul beside torch.mm (cuBLAS) at a 4096 x 14336 bf16 weight, M = 1, 64, 4096.
Writes benchmark/results/determinism_cpu.json (determinism_h200.json on CUDA).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_rt import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import chat, make_prompts  # noqa: E402

MATMUL_K, MATMUL_N = 4096, 14336


def run(engine: Engine, prompts: list[str] | list[list[int]], max_new: int):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True, logprobs=True)
    t = time.perf_counter()
    if isinstance(prompts[0], str):
        outs = engine.generate(prompts, sampling_params=sp)
    else:
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
    elapsed = time.perf_counter() - t
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    return sum(o.completion_tokens for o in outs) / elapsed, (prompt_tokens + max_new * len(outs)) / elapsed, outs


def matmul_rows() -> list[dict]:
    """Batch-invariant Triton matmul vs cuBLAS, bf16 x (M, K) @ w.t() with w (N, K) as the linear layers call it."""
    import triton

    from deepinfer_kernels.batch_invariant import matmul

    w = torch.randn(MATMUL_N, MATMUL_K, dtype=torch.bfloat16, device="cuda") / MATMUL_K**0.5
    rows = []
    for m in (1, 64, 4096):
        x = torch.randn(m, MATMUL_K, dtype=torch.bfloat16, device="cuda")
        ours = triton.testing.do_bench(lambda: matmul(x, w.t()), return_mode="median")
        cublas = triton.testing.do_bench(lambda: torch.mm(x, w.t()), return_mode="median")
        rows.append({"m": m, "k": MATMUL_K, "n": MATMUL_N, "invariant_ms": ours, "cublas_ms": cublas,
                     "invariant_over_cublas": ours / cublas})
        print(f"matmul M={m} K={MATMUL_K} N={MATMUL_N} bf16: invariant {ours:.3f} ms  cuBLAS {cublas:.3f} ms  "
              f"ratio {ours / cublas:.2f}", flush=True)
    return rows


def make_engines(args) -> dict[str, Engine]:
    model, extra = args.model, {}
    if args.dummy:
        from bench_gpu import SMOLLM2, V2_LITE, model_dir

        spec = {"smollm2-135m": SMOLLM2, "deepseek-v2-lite": V2_LITE}[args.dummy]
        model = str(model_dir(spec, Path(tempfile.mkdtemp(prefix=f"det-{args.dummy}-"))))
        extra = dict(load_format="dummy", kv_cache_tokens=args.num_prompts * 256 + 1024)
    return {mode: Engine(model, dtype=args.dtype, device=args.device, enable_prefix_cache=False,
                         batch_invariant=mode == "on", **extra) for mode in ("off", "on")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dummy", choices=["smollm2-135m", "deepseek-v2-lite"], default=None,
                    help="random weights of this shape instead of --model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    on_cuda = args.device.startswith("cuda")
    matmul = matmul_rows() if on_cuda else None
    engines = make_engines(args)
    if args.dummy:  # random weights: random token ids of the chat prompts' length (the tokenizer is another's)
        gen = torch.Generator().manual_seed(0)
        vocab = engines["off"].model_config.vocab_size
        prompts = [torch.randint(0, vocab, (36 + i % 3,), generator=gen).tolist() for i in range(args.num_prompts)]
    else:
        prompts = chat(engines["off"].tokenizer, make_prompts(args.num_prompts))
    for engine in engines.values():
        run(engine, prompts, 4)  # warm-up at the timed batch: kernels tuned, CUDA graphs captured
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
        "benchmark": "determinism", "model": args.dummy or args.model, "dummy_weights": bool(args.dummy),
        "device": torch.cuda.get_device_name() if on_cuda else args.device, "dtype": args.dtype,
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
    if matmul is not None:
        result["matmul_bf16"] = matmul
    print(f"output tok/s: off {med['off']:.1f}  on {med['on']:.1f}  ratio on/off {result['on_over_off']:.2f} "
          f"(overhead {result['overhead_pct']:.0f}%); mode-on batched == alone: {invariant}")
    name = "determinism_h200.json" if on_cuda else f"determinism_{args.device}.json"
    out = Path(args.out or Path(__file__).resolve().parent / "results" / name)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
