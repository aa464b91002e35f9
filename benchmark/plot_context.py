"""Plot the fraction of the bandwidth floor that decode reaches against context length, from bench_gpu.py's
JSON (one or more files: runs of other contexts or models are merged): one panel per model, a line per batch,
the engine (host included) solid and the replayed GPU step dashed.

    python benchmark/plot_context.py benchmark/results/gpu_h200_longctx.png benchmark/results/gpu_h200_longctx_*.json
"""
from __future__ import annotations

import json
import sys


def plot(result: dict, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in result if isinstance(result[m], dict) and result[m].get("decode")]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = [r for r in result[name]["decode"] if "skipped" not in r]
        for batch in sorted({r["batch"] for r in rows}):
            mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
            line, = ax.plot([r["context"] for r in mine], [r["fraction_of_floor"] for r in mine], "o-",
                            label=f"batch {batch}: engine")
            gpu = [r for r in mine if "gpu_fraction_of_floor" in r]
            ax.plot([r["context"] for r in gpu], [r["gpu_fraction_of_floor"] for r in gpu], "s--",
                    color=line.get_color(), alpha=0.6, label=f"batch {batch}: GPU step")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", ylim=(0, 1.05), xlabel="context (tokens)", ylabel="fraction of the bandwidth floor",
               title=name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result.get('device', '')}: decode against the floor by context")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def merge(paths: list[str]) -> dict:
    merged: dict = {}
    for path in paths:
        result = json.load(open(path))
        for key, value in result.items():
            if isinstance(value, dict) and "decode" in value:
                merged.setdefault(key, {"decode": []})["decode"].extend(value["decode"])
            else:
                merged.setdefault(key, value)
    return merged


if __name__ == "__main__":
    plot(merge(sys.argv[2:]), sys.argv[1])
