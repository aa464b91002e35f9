"""The DeepSeek-V4 / V4.1 decode sweep of bench_v4_sweep.py: throughput per GPU against tokens/s per user over the
batch sizes, one line per variant, context and mode (eager / CUDA graphs), beside the decode floor.

    python benchmark/plot_v4_sweep.py benchmark/results/v4_sweep_h200.json benchmark/results/v4_sweep_h200.png
"""
from __future__ import annotations

import json
import sys


def build_sweep(result: dict, variants) -> list[dict]:
    """Series of (tokens/s per user, tokens/s per GPU) points, one per batch, per variant, context and mode."""
    series = {}
    for name in variants:
        for row in result.get(name, {}).get("decode", []):
            key = (name, row["context"], row["mode"])
            s = series.setdefault(key, {"variant": name, "context": row["context"], "mode": row["mode"],
                                        "layers": result[name].get("layers"), "points": []})
            s["points"].append({"batch": row["batch"], "tok_s_per_gpu": row["tok_s"],
                                "tok_s_per_user": row["tok_s_per_user"], "floor_tok_s_per_gpu": row["floor_tok_s"],
                                "floor_tok_s_per_user": row["floor_tok_s"] / row["batch"],
                                "fraction_of_floor": row["fraction_of_floor"]})
    return list(series.values())


def plot(result: dict, dst: str) -> bool:
    """Writes the PNG; False (and a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return False
    sweep = result.get("sweep", [])
    contexts = sorted({s["context"] for s in sweep})
    if not contexts:
        return False
    fig, axes = plt.subplots(1, len(contexts), figsize=(7 * len(contexts), 5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for s in (s for s in sweep if s["context"] == context):
            pts = sorted(s["points"], key=lambda p: p["batch"])
            label = f"{s['variant']} ({s['layers']} layers) {s['mode']}"
            line, = ax.plot([p["tok_s_per_user"] for p in pts], [p["tok_s_per_gpu"] for p in pts], "o-", label=label)
            if s["mode"] == "eager":
                ax.plot([p["floor_tok_s_per_user"] for p in pts], [p["floor_tok_s_per_gpu"] for p in pts], "--",
                        color=line.get_color(), alpha=0.5, label=f"{s['variant']} floor")
            for p in pts:
                ax.annotate(str(p["batch"]), (p["tok_s_per_user"], p["tok_s_per_gpu"]), fontsize=7)
        ax.set(xscale="log", yscale="log", xlabel="tokens/s per user", ylabel="tokens/s per GPU",
               title=f"{context}-token context")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result.get('device', '')}: DeepSeek-V4 / V4.1 decode sweep (labels: batch)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return True


if __name__ == "__main__":
    src = json.load(open(sys.argv[1]))
    plot(src, sys.argv[2])
