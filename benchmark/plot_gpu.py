"""Plot benchmark/results/gpu_h200.json: decode tok/s against batch size, beside the bandwidth floor and
transformers, one panel per model.

    python benchmark/plot_gpu.py benchmark/results/gpu_h200.json benchmark/results/gpu_h200.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    result = json.load(open(src))
    models = [m for m in result if isinstance(result[m], dict) and "decode" in result[m]]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    for ax, name in zip(axes if len(models) > 1 else [axes], models):
        rows = [r for r in result[name]["decode"] if "skipped" not in r]
        rows = [r for r in rows if r["context"] == min(r["context"] for r in rows)]  # one context: bench_gpu's first
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["floor_tok_s"] for r in rows], "k--", label="bandwidth floor")
        ax.plot(batches, [r["gpu_tok_s"] for r in rows], "o-", label="GPU decode step (graph replay)")
        ax.plot(batches, [r["engine_tok_s"] for r in rows], "s-", label="engine (host included)")
        hf = result[name].get("transformers", [])
        ax.plot([r["batch"] for r in hf], [r["hf_tok_s"] for r in hf], "^:", label="transformers generate")
        ax.set(xscale="log", yscale="log", xlabel=f"batch ({rows[0]['context']}-token context)", ylabel="decode tok/s", title=name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result.get('device', '')}: decode throughput vs batch")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
