#!/usr/bin/env bash
# The one command the GPU machine runs (from the repository root): install the carried wheels (.whl/), run the
# GPU benchmark, then test/gpu/; logs and JSON land in $OUT. Stage time limits (seconds) come from the
# environment: BENCH_S, KERNEL_TEST_S, MODEL_TEST_S, KERNEL_BENCH_S (0 skips the kernel micro-benchmark).
#   device tool:  run(command="bash scripts/gpu_check.sh", carry=[".whl"])
set -u
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT" /tmp/kpath
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
ln -sfn "$PWD/kernels" /tmp/kpath/deepinfer_kernels
export PYTHONPATH=/tmp/site:/tmp/kpath:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
  > "$OUT/gpu_state.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout "${BENCH_S:-360}" python3 benchmark/bench_gpu.py --out "$OUT/gpu_h200.json" ${BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1
tail -n 16 "$OUT/bench.log"
timeout "${KERNEL_TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider test/gpu/test_gpu_kernels.py \
  > "$OUT/test_kernels.log" 2>&1
tail -n 3 "$OUT/test_kernels.log"
timeout "${MODEL_TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider test/gpu/test_gpu_model.py \
  > "$OUT/test_model.log" 2>&1
tail -n 3 "$OUT/test_model.log"
if [ "${KERNEL_BENCH_S:-60}" != 0 ]; then
  timeout "${KERNEL_BENCH_S:-60}" python3 benchmark/bench_kernels.py --out "$OUT/gpu_kernels_h200.json" \
    > "$OUT/bench_kernels.log" 2>&1
  tail -n 3 "$OUT/bench_kernels.log"
fi
