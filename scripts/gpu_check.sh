#!/usr/bin/env bash
# The one command the GPU machine runs (from the repository root): install the carried wheels (.whl/), then the
# stages named in STAGES (default bench,tests,kernel_bench,ep): the GPU benchmark, test/gpu/, the kernel
# micro-benchmark, and on a machine with two GPUs the expert-parallel check (scripts/gpu_ep_check.sh); the
# `determinism` stage (batch-invariant mode on vs off, SmolLM2- and V2-Lite-shaped) and the `host` stage (host
# time per decode step, overlap off and on, V2-Lite shape by default; HOST_ARGS), the `moe_invariant` stage (batch-invariant fused
# MoE beside the default one, V2-Lite shapes) and the `mxfp4` stage (the fused MXFP4 MoE beside the bf16 one at
# V4-Flash expert shapes), `v4` (bench_v4 at V4-Flash width), `fp8` (bench_fp8: FP8 beside bf16), `fp8_gemm` (bench_fp8_gemm: the FP8 GEMM's paths beside bf16 cuBLAS), `moe_fp8` (bench_moe_fp8: the FP8 fused MoE beside the bf16 one), `longctx`
# (bench_gpu at long contexts), `longctx_base` (the same on the commit that scripts/base_tree.sh wrote into base/), `row_gemv` (bench_row_gemv: the fused row products beside the module path's), `kv8` (bench_kv8_decode: MLA decode over an FP8 KV pool beside bf16), `ep1` (the EP worker pool at one rank beside the in-process engine) and `v4sweep`
# (bench_v4_sweep: V4-Flash / V4.1-Flash-shaped decode sweep beside the V4 floor, bf16 and release format) and
# `v4sweep_base` (the same sweep on base/, as longctx_base) run when named.
# Logs and JSON land in $OUT. Stage time limits (seconds): BENCH_S, TEST_S, KERNEL_BENCH_S, EP_S, DET_S, HOST_S,
# MOE_BI_S, MXFP4_S, V4_S, FP8_S, FP8_GEMM_S, MOE_FP8_S, LONGCTX_S, EP1_S, V4SWEEP_S, ROW_GEMV_S, KV8_S.
# `sampler` (bench_sampler: the one-kernel seeded draw beside the per-row form; SAMPLER_S, SAMPLER_ARGS).
# `v4attn` (bench_v4_attention: V4-Flash sparse attention, the fused kernel and tiles beside the split kernels; V4ATTN_S).
# LONGCTX_AB_ENV ('|'-separated settings): longctx again under each; LONGCTX2_ARGS (LONGCTX2_S): longctx once more with those rows; FP8_AB_ENV: fp8 again under those settings. PACK=1: everything in $OUT packed into one out.tgz (the
# device returns at most eight files). V4SWEEP_AB_ENV (with V4SWEEP_AB_ARGS, default V4SWEEP_ARGS): v4sweep again under those environment settings. TEST_ARGS: the pytest targets of the tests stage (default test/gpu); KERNEL_BENCH_ARGS: extra
# arguments of the kernel micro-benchmark (e.g. --only moe). TEST_JOBS>1: one pytest process per test file or node id, that
# many at once; PYTEST_ARGS: extra pytest options (e.g. -o faulthandler_timeout=120 to dump a stuck test's stacks).
#   device tool:  run(command="bash scripts/gpu_check.sh", carry=[".whl"])          (one H200)
#                 run(command="STAGES=tests,ep bash scripts/gpu_check.sh", kind="nvidia-h200-x2", carry=[".whl"])
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
STAGES=",${STAGES:-bench,tests,kernel_bench,ep},"
if [[ $STAGES == *,bench,* ]]; then
  timeout "${BENCH_S:-360}" python3 benchmark/bench_gpu.py --out "$OUT/gpu_h200.json" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  tail -n 16 "$OUT/bench.log"
fi
if [[ $STAGES == *,tests,* ]]; then
  if [ "${TEST_JOBS:-1}" -gt 1 ]; then
    # One pytest process per test file (TEST_ARGS: files or folders), TEST_JOBS at a time on the one GPU (the
    # tests are compile- and host-bound); TEST_S limits each file. Logs: $OUT/test_<file>.log.
    export OUT TEST_S=${TEST_S:-300} PYTEST_ARGS=${PYTEST_ARGS:-}
    # A folder stands for its test files; a file or a node id (file::test[params]) runs as its own process.
    for t in ${TEST_ARGS:-test/gpu}; do if [ -d "$t" ]; then find "$t" -name 'test_*.py' | sort; else echo "$t"; fi; done \
      | OMP_NUM_THREADS=2 xargs -P "$TEST_JOBS" -I{} bash -c \
      'log=$(basename "{}" | sed "s/\.py//; s/[^A-Za-z0-9_.-]/_/g"); timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider -rf --durations=5 ${PYTEST_ARGS:-} "{}" > "$OUT/test_$log.log" 2>&1; echo "{} rc=$?"' \
      | tee "$OUT/test_files_rc.txt"
    for f in "$OUT"/test_test_*.log; do echo "== $f"; grep -E "passed|failed|error|FAILED|ERROR" "$f" | tail -n 6; done
    if grep -qv "rc=0$" "$OUT/test_files_rc.txt"; then echo "tests: some file failed"; fi
    # One file back instead of one per test file: the device returns a limited number of files, and the logs
    # would crowd out the benchmarks' JSON.
    for f in "$OUT"/test_files_rc.txt "$OUT"/test_test_*.log; do echo "===== $(basename "$f")"; cat "$f"; done \
      > "$OUT/tests.log" && rm -f "$OUT"/test_test_*.log "$OUT/test_files_rc.txt"
  else
    timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -rf ${PYTEST_ARGS:-} ${TEST_ARGS:-test/gpu} > "$OUT/test_gpu.log" 2>&1
    tail -n 12 "$OUT/test_gpu.log"
  fi
fi
if [[ $STAGES == *,kernel_bench,* ]]; then
  timeout "${KERNEL_BENCH_S:-60}" python3 benchmark/bench_kernels.py --out "$OUT/gpu_kernels_h200.json" \
    ${KERNEL_BENCH_ARGS:-} > "$OUT/bench_kernels.log" 2>&1
  tail -n 3 "$OUT/bench_kernels.log"
fi
if [[ $STAGES == *,determinism,* ]]; then
  timeout "${DET_S:-150}" bash -c "python3 benchmark/bench_determinism.py --device cuda --dtype bfloat16 \
      --dummy smollm2-135m --out '$OUT/determinism_h200.json' \
    && python3 benchmark/bench_determinism.py --device cuda --dtype bfloat16 --dummy deepseek-v2-lite \
      --num-prompts 8 --max-new-tokens 16 --out '$OUT/determinism_v2lite_h200.json'" > "$OUT/determinism.log" 2>&1
  grep -E "^(matmul|output)" "$OUT/determinism.log"; tail -n 3 "$OUT/determinism.log"
fi
if [[ $STAGES == *,host,* ]]; then
  timeout "${HOST_S:-150}" python3 benchmark/bench_host.py --device cuda --out "$OUT/host_h200.json" \
    ${HOST_ARGS:---model deepseek-v2-lite --context 2048 --steps 16} > "$OUT/host.log" 2>&1
  tail -n 40 "$OUT/host.log"
fi
if [[ $STAGES == *,moe_invariant,* ]]; then
  timeout "${MOE_BI_S:-180}" python3 benchmark/bench_kernels.py --device cuda --only moe_invariant \
    --out "$OUT/gpu_moe_invariant_h200.json" > "$OUT/moe_invariant.log" 2>&1
  tail -n 6 "$OUT/moe_invariant.log"
fi
if [[ $STAGES == *,mxfp4,* ]]; then
  timeout "${MXFP4_S:-240}" python3 benchmark/bench_kernels.py --only mxfp4 --out "$OUT/gpu_mxfp4_moe_h200.json" \
    ${MXFP4_ARGS:-} > "$OUT/mxfp4.log" 2>&1
  tail -n 6 "$OUT/mxfp4.log"
fi
if [[ $STAGES == *,v4,* ]]; then  # V4 / V4.1 / MLA shapes at V4-Flash width, decode at batch 1 and 64
  for b in ${V4_BATCHES:-1 64}; do
    timeout "${V4_S:-150}" python3 benchmark/bench_v4.py --device cuda --dtype bfloat16 --layers 3 --experts 64 \
      --vocab 129280 --batch "$b" --context 2048 --repeats 3 > "$OUT/v4_b$b.log" 2>&1
    cp benchmark/results/v4_cuda.json "$OUT/v4_cuda_b$b.json" 2>/dev/null
    tail -n 14 "$OUT/v4_b$b.log"
  done
fi
if [[ $STAGES == *,fp8,* ]]; then  # FP8 beside bf16 (V2-Lite), a full-width V3 in FP8, weight bytes per GPU
  timeout "${FP8_S:-300}" python3 benchmark/bench_fp8.py --out "$OUT/fp8_h200.json" ${FP8_ARGS:-} > "$OUT/fp8.log" 2>&1
  tail -n 12 "$OUT/fp8.log"
  if [ -n "${FP8_AB_ENV:-}" ]; then  # the same run under these settings (e.g. DEEPINFER_GPU_PDL=0)
    env ${FP8_AB_ENV} timeout "${FP8_S:-300}" python3 benchmark/bench_fp8.py --out "$OUT/fp8_ab.json" ${FP8_ARGS:-} \
      > "$OUT/fp8_ab.log" 2>&1
    echo "fp8 ($FP8_AB_ENV) rc=$?"; tail -n 8 "$OUT/fp8_ab.log"
  fi
fi
if [[ $STAGES == *,moe_fp8,* ]]; then  # the FP8 fused MoE (tiles, autotuned) beside the bf16 one, V2-Lite experts
  timeout "${MOE_FP8_S:-240}" python3 benchmark/bench_moe_fp8.py --out "$OUT/gpu_moe_fp8_h200.json" ${MOE_FP8_ARGS:-} \
    > "$OUT/moe_fp8.log" 2>&1
  echo "moe_fp8 rc=$?"
  grep -E "^T=" "$OUT/moe_fp8.log" | grep -v " N[0-9]" ; tail -n 2 "$OUT/moe_fp8.log"
fi
if [[ $STAGES == *,fp8_gemm,* ]]; then  # the FP8 GEMM's paths (fused, tiled, scaled_mm) beside bf16 cuBLAS
  timeout "${FP8_GEMM_S:-240}" python3 benchmark/bench_fp8_gemm.py --out "$OUT/gpu_fp8_gemm_h200.json" \
    ${FP8_GEMM_ARGS:-} > "$OUT/fp8_gemm.log" 2>&1
  echo "fp8_gemm rc=$?"
  tail -n 4 "$OUT/fp8_gemm.log"
fi
if [[ $STAGES == *,row_gemv,* ]]; then  # the fused row products beside the module path's kernels
  timeout "${ROW_GEMV_S:-240}" python3 benchmark/bench_row_gemv.py --out "$OUT/gpu_row_gemv_h200.json" ${ROW_GEMV_ARGS:-} \
    > "$OUT/row_gemv.log" 2>&1
  grep -E "a layer|module" "$OUT/row_gemv.log" | tail -n 12
fi
if [[ $STAGES == *,kv8,* ]]; then  # MLA decode attention over an FP8 KV pool beside bf16 (dots' dtype, tiles)
  timeout "${KV8_S:-240}" python3 benchmark/bench_kv8_decode.py --out "$OUT/gpu_kv8_decode_h200.json" ${KV8_ARGS:-} \
    > "$OUT/kv8.log" 2>&1
  echo "kv8 rc=$?"
  grep -E "None stages=None" "$OUT/kv8.log"; tail -n 3 "$OUT/kv8.log"
fi
if [[ $STAGES == *,longctx,* ]]; then  # decode at long contexts beside the floor (bench_gpu.py --contexts)
  timeout "${LONGCTX_S:-300}" python3 benchmark/bench_gpu.py --out "$OUT/gpu_h200_longctx.json" \
    ${LONGCTX_ARGS:---models deepseek-v2-lite smollm2-135m --contexts 2048 32768 --batches 1 16 64 --hf-batches --steps 16 --profile-steps 0} \
    > "$OUT/longctx.log" 2>&1
  tail -n 16 "$OUT/longctx.log"
  # LONGCTX_AB_ENV: '|'-separated environment settings, each a rerun of the same benchmark (gpu_longctx_ab<i>.json)
  i=0; IFS='|' read -ra AB <<< "${LONGCTX_AB_ENV:-}"
  for e in "${AB[@]}"; do
    i=$((i + 1))
    env $e timeout "${LONGCTX_S:-300}" python3 benchmark/bench_gpu.py --out "$OUT/gpu_longctx_ab$i.json" \
      ${LONGCTX_ARGS:---models deepseek-v2-lite smollm2-135m --contexts 2048 32768 --batches 1 16 64 --hf-batches --steps 16 --profile-steps 0} \
      > "$OUT/longctx_ab$i.log" 2>&1
    echo "longctx ($e) rc=$?"; tail -n 6 "$OUT/longctx_ab$i.log"
  done
  if [ -n "${LONGCTX2_ARGS:-}" ]; then  # a second run with other rows (e.g. one long, memory-heavy row on its own)
    timeout "${LONGCTX2_S:-300}" python3 benchmark/bench_gpu.py --out "$OUT/gpu_h200_longctx2.json" $LONGCTX2_ARGS \
      > "$OUT/longctx2.log" 2>&1
    echo "longctx2 rc=$?"; tail -n 8 "$OUT/longctx2.log"
  fi
fi
if [[ $STAGES == *,longctx_base,* ]] && [ -d base ]; then  # the same benchmark on base/ (scripts/base_tree.sh REV)
  mkdir -p /tmp/kbase && ln -sfn "$PWD/base/kernels" /tmp/kbase/deepinfer_kernels
  PYTHONPATH=/tmp/site:/tmp/kbase:$PWD/base timeout "${LONGCTX_S:-300}" python3 base/benchmark/bench_gpu.py \
    --out "$OUT/gpu_longctx_base.json" \
    ${LONGCTX_ARGS:---models deepseek-v2-lite smollm2-135m --contexts 2048 32768 --batches 1 16 64 --hf-batches --steps 16 --profile-steps 0} \
    > "$OUT/longctx_base.log" 2>&1
  tail -n 16 "$OUT/longctx_base.log"
fi
if [[ $STAGES == *,sampler,* ]]; then  # seeded sampling: the one-kernel draw beside the former per-row form
  timeout "${SAMPLER_S:-120}" python3 benchmark/bench_sampler.py --out "$OUT/sampler_h200.json" ${SAMPLER_ARGS:-} \
    > "$OUT/sampler.log" 2>&1
  tail -n 10 "$OUT/sampler.log"
fi
if [[ $STAGES == *,v4attn,* ]]; then  # V4-Flash decode attention: split kernels + combine vs the fused kernel, tiles
  timeout "${V4ATTN_S:-120}" python3 benchmark/bench_v4_attention.py --out "$OUT/gpu_v4_attention_h200.json" \
    > "$OUT/v4attn.log" 2>&1
  echo "v4attn rc=$?"; grep -E "'us'" "$OUT/v4attn.log" | cut -c1-200 | tail -n 63
fi
if [[ $STAGES == *,ep1,* ]]; then  # the EP worker pool at one rank beside the in-process engine (one GPU)
  timeout "${EP1_S:-300}" python3 benchmark/bench_ep.py --shape v2-lite --device cuda --dtype bfloat16 \
    --batch 16,64,256 --ep 1 --skew 0 --message-cost --out "$OUT/ep_h200.json" ${EP1_ARGS:-} > "$OUT/ep1.log" 2>&1
  tail -n 12 "$OUT/ep1.log"
fi
if [[ $STAGES == *,v4sweep,* ]]; then  # V4 / V4.1 decode sweep (as many layers as fit), JSON + PNG after every row
  timeout "${V4SWEEP_S:-420}" python3 benchmark/bench_v4_sweep.py --out "$OUT/v4_sweep_h200.json" \
    ${V4SWEEP_ARGS:---contexts 8192 32768 --batches 1 16 64 256 --steps 6 --row-budget-s 3} > "$OUT/v4sweep.log" 2>&1
  echo "v4sweep rc=$?"
  tail -n 40 "$OUT/v4sweep.log"
  if [ -n "${V4SWEEP_AB_ENV:-}" ]; then  # the same sweep again under these settings (e.g. DEEPINFER_FP8_SPLIT_SUM=...)
    env ${V4SWEEP_AB_ENV} timeout "${V4SWEEP_S:-420}" python3 benchmark/bench_v4_sweep.py --out "$OUT/v4_sweep_ab.json" \
      ${V4SWEEP_AB_ARGS:-${V4SWEEP_ARGS:---contexts 8192 32768 --batches 1 16 64 256 --steps 6 --row-budget-s 3}} \
      > "$OUT/v4sweep_ab.log" 2>&1
    echo "v4sweep ($V4SWEEP_AB_ENV) rc=$?"
    tail -n 20 "$OUT/v4sweep_ab.log"
  fi
fi
if [[ $STAGES == *,v4sweep_base,* ]] && [ -d base ]; then  # the same sweep on base/ (scripts/base_tree.sh REV)
  mkdir -p /tmp/kbase && ln -sfn "$PWD/base/kernels" /tmp/kbase/deepinfer_kernels
  PYTHONPATH=/tmp/site:/tmp/kbase:$PWD/base timeout "${V4SWEEP_S:-420}" python3 base/benchmark/bench_v4_sweep.py \
    --out "$OUT/v4_sweep_base.json" \
    ${V4SWEEP_ARGS:---contexts 8192 32768 --batches 1 16 64 256 --steps 6 --row-budget-s 3} > "$OUT/v4sweep_base.log" 2>&1
  echo "v4sweep_base rc=$?"
  tail -n 20 "$OUT/v4sweep_base.log"
fi
if [[ $STAGES == *,ep,* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  OUT=$OUT timeout "${EP_S:-400}" bash scripts/gpu_ep_check.sh > "$OUT/ep.log" 2>&1
  tail -n 20 "$OUT/ep.log"
fi
if [ "${PACK:-0}" = 1 ]; then
  tar czf /tmp/out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/out.tgz "$OUT/out.tgz"
fi
