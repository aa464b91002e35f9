"""A command's wall time on this checkout against the same command on an earlier commit, in one run, alternating.

    python benchmark/bench_against_commit.py --base fa45d6a^ --pairs 3 -- python examples/extract_json.py

The earlier commit is checked out into a temporary git worktree and its packages (deepinfer_rt, deepinfer_lang and
kernels/ as deepinfer_kernels) are put first on PYTHONPATH for its runs, so both sides use this environment's
installed libraries and differ only in the project's code. The command runs in each side's root; the sides
alternate (base, ours, base, ours, ...) so that a busy moment of a shared machine falls on both. Each run's
wall time and the last line of its output go to the JSON (`--out`), with the medians and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _packages_of(tree: Path, into: Path) -> None:
    """A folder whose entries are the tree's importable packages (kernels/ under its import name)."""
    into.mkdir(parents=True, exist_ok=True)
    for name, folder in (("deepinfer_rt", "deepinfer_rt"), ("deepinfer_lang", "deepinfer_lang"),
                         ("deepinfer_kernels", "kernels")):
        (into / name).symlink_to(tree / folder)


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str, int]:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines()
    return wall, lines[-1] if lines else "", done.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "against_commit.json"))
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to time")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to time after --")
    base = _git("rev-parse", args.base)
    ours = _git("rev-parse", "HEAD") + ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")
    with tempfile.TemporaryDirectory(prefix="deepinfer-base-") as tmp:
        tree, shim = Path(tmp) / "tree", Path(tmp) / "packages"
        _git("worktree", "add", "--detach", str(tree), base)
        try:
            _packages_of(tree, shim)
            paths = [str(shim)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # no '' (cwd)
            env_base = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
            env_ours = dict(os.environ)
            probe = "import deepinfer_rt, deepinfer_kernels; print(deepinfer_rt.__file__, deepinfer_kernels.__file__)"
            for side, env, root in (("base", env_base, tree), ("ours", env_ours, ROOT)):
                files = subprocess.run([sys.executable, "-c", probe], cwd=Path(tmp), env=env, check=True,
                                       capture_output=True, text=True).stdout.split()
                if not all(Path(f).resolve().is_relative_to(root.resolve()) for f in files):
                    sys.exit(f"the {side} side imports the project from {files}, not from {root}")
            runs: dict[str, list[dict]] = {"base": [], "ours": []}
            for i in range(args.pairs):
                for side, cwd, env in (("base", tree, env_base), ("ours", ROOT, env_ours)):
                    wall, last, rc = _run(command, cwd, env)
                    if rc != 0:
                        sys.exit(f"{side} run {i} failed (exit {rc}): {last}")
                    runs[side].append({"wall_s": round(wall, 3), "last_line": last})
                    print(f"pair {i} {side:4s} {wall:6.2f} s  {last}", flush=True)
        finally:
            _git("worktree", "remove", "--force", str(tree))
    median = {side: statistics.median(r["wall_s"] for r in rs) for side, rs in runs.items()}
    result = {"command": command, "base": base, "ours": ours, "pairs": args.pairs, "runs": runs,
              "median_s": median, "speedup": round(median["base"] / median["ours"], 3),
              "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"median: base {median['base']:.2f} s, ours {median['ours']:.2f} s: {result['speedup']:.2f}x  -> {args.out}")


if __name__ == "__main__":
    main()
