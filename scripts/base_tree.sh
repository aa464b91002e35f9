#!/usr/bin/env bash
# Write the code of another commit into base/ (git-ignored), for before/after timings in one device call:
#   bash scripts/base_tree.sh 7c178a2
#   run(command="STAGES=longctx,longctx_base LONGCTX_ARGS=... bash scripts/gpu_check.sh", carry=[".whl", "base"])
# gpu_check's `longctx_base` stage then runs base/'s bench_gpu.py with base/'s packages and the same LONGCTX_ARGS.
set -eu
rev=${1:?usage: scripts/base_tree.sh REV}
rm -rf base && mkdir base
git archive "$rev" deepinfer_rt deepinfer_lang kernels benchmark scripts | tar -x -C base
echo "base/ holds $(git rev-parse --short "$rev")"
