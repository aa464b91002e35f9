"""Seeded sampling of a decode batch on CUDA: the one-kernel Gumbel-max draw (deepinfer_kernels.sampling, what
`Sampler.sample` runs now) beside the former per-row form (a torch CUDA generator seeded per row, its uniforms,
then log / log / argmax over the stacked batch), in the same run, on the same logits.

Timed per call as the engine's loop sees it, host and GPU together: `calls` back-to-back calls and one
synchronize, over the number of calls (the former form cannot be captured in a CUDA graph: it builds generators).
Beside both, the physical floor: the batch's fp32 logits read once at the copy bandwidth measured in the run.

    python benchmark/bench_sampler.py --out benchmark/results/sampler_h200.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer_kernels.sampling import gumbel_argmax
from deepinfer_rt.sampler import stream_seed, to_device, uniform_noise


def per_row_form(z: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """The sampler's draw before the kernel: one seeded generator and torch.rand per row."""
    noise = torch.stack([uniform_noise(s, p, z.shape[-1], z.device) for s, p in zip(seeds, positions)])
    return (z - torch.log(-torch.log(noise))).argmax(-1)


def kernel_form(z: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """The sampler's draw now (sampler.gumbel_draw on CUDA): stream seeds up, one kernel."""
    stream = [stream_seed(s, p) for s, p in zip(seeds, positions)]
    return gumbel_argmax(z, to_device(stream, torch.long, z.device))


def per_call_seconds(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def copy_bandwidth() -> float:
    n = 1 << 28
    src, dst = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 129280])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="benchmark/results/sampler_h200.json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for vocab in args.vocab:
        for batch in args.batches:
            z = torch.randn(batch, vocab, device="cuda") * 3
            seeds, positions = list(range(batch)), [7 + i for i in range(batch)]
            assert torch.equal(kernel_form(z, seeds, positions), kernel_form(z, seeds, positions))
            old = per_call_seconds(lambda: per_row_form(z, seeds, positions), args.calls)
            new = per_call_seconds(lambda: kernel_form(z, seeds, positions), args.calls)
            floor = batch * vocab * 4 / bw
            rows.append({"vocab": vocab, "batch": batch, "per_row_form_us": old * 1e6, "kernel_us": new * 1e6,
                         "speedup": old / new, "floor_us": floor * 1e6, "kernel_of_floor": floor / new})
            print(f"V={vocab} B={batch}: per-row form {old * 1e6:8.1f} us, kernel {new * 1e6:7.1f} us "
                  f"({old / new:5.1f}x), floor {floor * 1e6:6.1f} us ({floor / new:.2f})", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bw,
              "calls": args.calls, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
