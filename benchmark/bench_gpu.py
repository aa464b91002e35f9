"""GPU benchmark: decode and prefill of random-weight models beside the memory-bandwidth floor and transformers.

For each model shape (DeepSeek-V2-Lite: MLA + MoE; SmolLM2-135M: GQA) and context length, in one process on
one GPU:
  ceilings   device copy bandwidth (bytes read + written) and the bf16 matmul rate, measured first;
  decode     B requests with `context`-token prompts; once all are prefilled, `steps` engine steps with the whole
             batch decoding (requests run long enough not to finish inside them): engine tok/s over those
             steps (host included), and the GPU time of one decode step (CUDA-graph replay + LM head);
  floor      bytes one decode step must read (PERF.md: always-used weights, the routed experts the batch is
             expected to touch, the KV attended) over the copy bandwidth -> tok/s; fraction = ours / floor;
  prefill    4 x `context`-token prompts, tokens/s and FLOP/s over the measured matmul rate;
  peer       transformers `generate` on the same architecture (random weights), decode tok/s at batch 1, 32.

Every decode row gives wall ms per step beside kernel ms per step (the profiled real steps) and the fraction of
the floor. Measurement is checked, never trusted: the replayed graph must be the one the timed steps ran, its
page table rows must hold every request's pages and it must attend to each whole context (check_covers), and
a figure above the floor fails the run (a bug in the benchmark or in the floor). Batches whose KV does not fit
the pool at a context are reported as skipped. `--plot` draws the fraction of the floor against context.

    python benchmark/bench_gpu.py --out benchmark/results/gpu_h200.json
    python benchmark/bench_gpu.py --models deepseek-v2-lite --contexts 2048 32768 131072 --batches 1 16 64 \
        --hf-batches --steps 16 --profile-steps 1 --out benchmark/results/gpu_h200_longctx_v2.json --plot
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from deepinfer_rt import Engine, SamplingParams  # noqa: E402
# bench_fp8.py and bench_v4_sweep.py take bench_prefill and _profile from here
from gpu_prefill import _profile, _sync, bench_prefill, bench_prefill_mixed, bench_prefill_unsplit  # noqa: E402

V2_LITE = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax", norm_topk_prob=False,
    routed_scaling_factor=1.0, max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707), rms_norm_eps=1e-6)
SMOLLM2 = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-5)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script's logic only
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"
TINY = dict(V2_LITE, vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=4096)


PREFILL_CHUNK = 8192
"""Prompt tokens per engine step (chunked prefill)."""


@contextlib.contextmanager
def env_vars(**values):
    """Settings (DEEPINFER_* read at an engine's build) for the body, restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def model_dir(spec: dict, out: Path) -> Path:
    """A config.json (+ any tokenizer: the benchmark feeds token ids) for load_format='dummy'."""
    import transformers
    from make_tiny_checkpoint import _TOKENIZER_FILES, _tokenizer_dir

    spec = dict(spec)
    cls = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    cls.save_pretrained(out)
    tok = _tokenizer_dir("deepseek_v2")
    for name in _TOKENIZER_FILES:
        if (tok / name).exists():
            shutil.copy(tok / name, out / name)
    return out


def _cuda_time(fn, iters: int) -> float:
    """Median seconds of fn() over iters runs, by CUDA events."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way, far beyond L2
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _cuda_time(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = _cuda_time(lambda: a @ b, 20)
    del src, dst, a, b
    return {"copy_bytes_per_s": 2 * n / copy_s, "bf16_matmul_flop_per_s": 2 * 8192**3 / mm_s}


def weight_bytes(engine: Engine) -> tuple[int, float, int]:
    """(bytes of weights every step reads, bytes of one routed expert, number of MoE layers)."""
    always, experts, moe_layers = 0, 0, 0
    for name, p in engine.model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:
            experts += size
            moe_layers += name.endswith("gate_up_proj")
        elif "embed_tokens" not in name or engine.model_config.tie_word_embeddings:
            always += size  # an untied embedding table is only gathered (B rows)
    per_expert = experts / (moe_layers * engine.model_config.n_routed_experts) if moe_layers else 0.0
    return always, per_expert, moe_layers


def decode_floor(engine: Engine, batch: int, context: int, copy_bw: float) -> dict:
    mc = engine.model_config
    always, expert, moe_layers = weight_bytes(engine)
    touched = mc.n_routed_experts * (1 - (1 - mc.num_experts_per_tok / mc.n_routed_experts) ** batch) \
        if moe_layers else 0.0
    kv = batch * context * engine.pool.layout.bytes_per_token(engine.config.dtype, engine.config.cache.kv_cache_dtype)
    total = always + moe_layers * touched * expert + kv
    return {"bytes": total, "step_s": total / copy_bw, "tok_s": batch / (total / copy_bw)}


WARMUP_STEPS = 2
"""Full-batch decode steps run before the timed ones: a first row in a process paid one-time costs inside its
timed steps (SmolLM2, 32K, batch 1: 4.98 ms of wall per step against a 1.39 ms replayed graph, H100)."""


def _decode_tokens(batch: int, context: int, steps: int) -> int:
    """New tokens per request: the warmup and timed steps, plus the steps that prefill the batch (requests
    prefilled early decode meanwhile), so every request is still running through the timed window (and the KV
    pool, sized from this, holds them)."""
    return WARMUP_STEPS + steps + -(-batch * context // PREFILL_CHUNK) + 2


class MeasurementError(AssertionError):
    """A figure the benchmark cannot stand behind (above the floor, or a replay that is not the real step)."""


def bench_decode(engine: Engine, batch: int, context: int, steps: int, copy_bw: float, vocab: int,
                 profile_steps: int = 0) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, context), generator=g).tolist()
    params = SamplingParams(max_new_tokens=_decode_tokens(batch, context, steps + profile_steps), temperature=0.0,
                            ignore_eos=True)
    with engine.hold_loop():  # this thread steps the engine, so each timed step is exactly one loop turn
        return _bench_decode_held(engine, prompts, params, batch, context, steps, copy_bw, profile_steps)


def _bench_decode_held(engine: Engine, prompts, params, batch: int, context: int, steps: int, copy_bw: float,
                       profile_steps: int) -> dict:
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    while not all(r.num_output_tokens >= 1 for r in reqs):
        engine.step()
    for _ in range(WARMUP_STEPS):  # the batch's first full steps (kernels built for this shape) are not timed
        engine.step()
    _sync()
    graphs = engine.executor.graphs
    replays0 = graphs.num_replays if graphs is not None else 0
    n0, t0 = sum(r.num_output_tokens for r in reqs), time.perf_counter()
    for _ in range(steps):  # full-batch decode steps only
        engine.step()
    _sync()
    seconds = time.perf_counter() - t0
    num_replayed = (graphs.num_replays - replays0) if graphs is not None else 0
    tok_s = (sum(r.num_output_tokens for r in reqs) - n0) / seconds
    full_batch = not any(r.is_finished for r in reqs)
    floor = decode_floor(engine, batch, context, copy_bw)
    row = {"batch": batch, "context": context, "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
           "full_batch_throughout": full_batch, "engine_tok_s": tok_s,
           "wall_ms_per_step": seconds / steps * 1e3, "graph_steps": num_replayed, "floor_tok_s": floor["tok_s"],
           "floor_ms_per_step": floor["step_s"] * 1e3,
           "floor_bytes": floor["bytes"], "fraction_of_floor": tok_s / floor["tok_s"]}
    if profile_steps:
        row["step_profile"] = _step_profile(engine, profile_steps)
        if "kernel_ms_per_step" in row["step_profile"]:
            row["kernel_ms_per_step"] = row["step_profile"]["kernel_ms_per_step"]
            row["profiled_wall_ms_per_step"] = row["step_profile"]["wall_ms_per_step"]
    live = [r for r in reqs if not r.is_finished]
    if graphs is not None and batch in graphs._graphs and num_replayed == steps and len(live) == batch:
        # The replay below must read the bytes the real step read: the last real step ran this graph, and its
        # inputs attend to every request's whole context through rows that hold all its pages.
        graphs.check_covers(live)
        # The step that just ran, every row still decoding: replay it (inputs kept). Replaying rewrites the same
        # KV slots with the same values.
        def replay():
            graphs.replay_step(batch)  # the graph, its logits and their argmax

        step_s = _cuda_time(replay, 20)
        row.update(gpu_step_ms=step_s * 1e3, gpu_tok_s=batch / step_s,
                   gpu_fraction_of_floor=(batch / step_s) / floor["tok_s"])
        row["profile"] = _profile(replay)
    for key in ("fraction_of_floor", "gpu_fraction_of_floor"):
        if row.get(key, 0.0) > 1.0:
            raise MeasurementError(f"batch {batch}, context {context}: {key} {row[key]:.2f} is above the floor")
    while not all(r.is_finished for r in reqs):
        engine.step()
    return row


def _step_profile(engine: Engine, steps: int) -> dict:
    """Every GPU kernel of `steps` real engine steps, in and out of the CUDA graph: kernel time per step beside
    wall time per step (their gap is time the GPU sat idle), and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        _sync()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            _sync()
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
        return {"steps": steps, "wall_ms_per_step": wall / steps * 1e3,
                "kernel_ms_per_step": kernel_us / steps / 1e3,
                "top": events.table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=60
                                    ).splitlines()}
    except Exception as e:  # a diagnostic: its failure must not lose the figures
        return {"error": repr(e)}


class _StepClock:
    """A transformers streamer that timestamps each generation step (after the GPU finishes it)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        _sync()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def bench_hf(path: Path, batches: list[int], context: int, steps: int, vocab: int) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    rows = []
    try:
        for batch in batches:
            ids = torch.randint(0, vocab, (batch, context), device=DEVICE)
            clock = _StepClock()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, streamer=clock, pad_token_id=0)
            # times[0]: the prompt; times[1]: the first token (prefill); later ones: decode steps
            decode_s = clock.times[-1] - clock.times[1]
            rows.append({"batch": batch, "context": context, "hf_tok_s": batch * (len(clock.times) - 2) / decode_s})
            if clock.times[-1] - t0 > 60:
                break
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _kv_bytes_per_token(spec: dict, kv_dtype: str = "auto") -> int:
    """KV bytes one token takes in the pool (MLA: the latent and rope key; GQA: K and V): bf16, or with fp8_e4m3
    one byte a value plus a float32 scale per row."""
    if "kv_lora_rank" in spec:
        values, rows = spec["kv_lora_rank"] + spec["qk_rope_head_dim"], 1
    else:
        rows = 2 * spec["num_key_value_heads"]
        values = rows * (spec["hidden_size"] // spec["num_attention_heads"])
    per_layer = values * 2 if kv_dtype == "auto" else values + 4 * rows
    return spec["num_hidden_layers"] * per_layer


def _fitting(spec: dict, batches: list[int], context: int, args) -> tuple[list[int], list[dict]]:
    """The batches whose KV fits the device beside the weights at `context` tokens, and a row per skipped one."""
    if DEVICE != "cuda":
        return batches, []
    budget = 0.8 * torch.cuda.mem_get_info()[0] - 40 * 2**30  # weights, activations and graphs kept aside
    keep, skipped = [], []
    for b in batches:
        need = (b * (context + _decode_tokens(b, context, args.steps + args.profile_steps) + 8)
                * _kv_bytes_per_token(spec, args.kv_dtype))
        if need <= budget:
            keep.append(b)
        else:
            skipped.append({"batch": b, "context": context, "skipped": f"KV of {need / 2**30:.0f} GiB does not fit"})
    return keep, skipped


def run_model(name: str, spec: dict, args, ceil: dict, result: dict, save) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    spec = dict(spec, max_position_embeddings=max(spec["max_position_embeddings"], max(args.contexts) + 4096))
    path = model_dir(spec, work)
    vocab = spec["vocab_size"]
    section = result.setdefault(name, {})
    section["decode"], section["prefill"] = [], []
    for context in args.contexts:
        batches, skipped = _fitting(spec, args.batches, context, args)
        section["decode"].extend(skipped)
        if not batches:
            continue
        max_bs = max(batches)
        engine = Engine(str(path), dtype=DTYPE, device=DEVICE, load_format="dummy", max_num_seqs=max_bs,
                        kv_cache_tokens=max(max_bs, 4) * (context + 8 + _decode_tokens(
                            max_bs, context, args.steps + args.profile_steps)),
                        chunked_prefill_tokens=PREFILL_CHUNK, enable_prefix_cache=False, kv_cache_dtype=args.kv_dtype)
        try:
            for batch in batches:
                section["decode"].append(bench_decode(engine, batch, context, args.steps,
                                                      ceil["copy_bytes_per_s"], vocab, args.profile_steps))
                save()
                print(name, {k: v for k, v in section["decode"][-1].items() if "profile" not in k}, flush=True)
            if context in args.prefill_contexts:
                section["prefill"].append(bench_prefill(engine, context, 4, ceil["bf16_matmul_flop_per_s"], vocab))
                print(name, {k: v for k, v in section["prefill"][-1].items() if k != "profile"}, flush=True)
                if args.prefill_split_ab:
                    section["prefill"].append(bench_prefill_unsplit(engine, context, ceil, vocab))
                    print(name, {k: v for k, v in section["prefill"][-1].items() if k != "profile"}, flush=True)
            if args.prefill_mixed:
                section.setdefault("prefill_mixed", []).append(
                    dict(bench_prefill_mixed(engine, args.prefill_mixed, context, vocab), context=context))
                print(name, "mixed lengths", section["prefill_mixed"][-1], flush=True)
        finally:
            engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        save()
    if not args.hf_batches:
        return
    try:  # after ours: one model on the GPU at a time
        section["transformers"] = bench_hf(path, args.hf_batches, min(args.contexts), args.hf_steps, vocab)
    except Exception:  # a peer failure must not lose our own figures
        section["transformers_error"] = traceback.format_exc()[-2000:]
    save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmark/results/gpu_h200.json")
    parser.add_argument("--models", nargs="+", default=["deepseek-v2-lite", "smollm2-135m"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 32], help="none: skip the peer")
    parser.add_argument("--profile-steps", type=int, default=4, help="real engine steps profiled per batch")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048], help="prompt tokens per request")
    parser.add_argument("--context", type=int, help="one context (same as --contexts N)")
    parser.add_argument("--prefill-mixed", type=int, default=0, metavar="N",
                        help="also prefill N prompts of distinct lengths up to the context, twice: the first pass "
                             "meets every attention shape new (cuDNN plans per shape)")
    parser.add_argument("--prefill-split-ab", action="store_true",
                        help="MLA models: measure each prefill again with chunks over a prefix in one masked "
                             "SDPA call (mla_prefix_split off)")
    parser.add_argument("--prefill-contexts", type=int, nargs="*", default=[2048, 32768],
                        help="contexts whose 4-prompt prefill is measured too")
    parser.add_argument("--plot", action="store_true", help="draw the fraction of the floor against context")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                        help="the engine's kv_cache_dtype (fp8_e4m3: half the KV bytes, in the floor too)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--hf-steps", type=int, default=8)
    args = parser.parse_args()
    if args.context is not None:
        args.contexts = [args.context]
    specs = {"deepseek-v2-lite": V2_LITE, "smollm2-135m": SMOLLM2, "tiny": TINY}
    ceil = ceilings() if DEVICE == "cuda" else {"copy_bytes_per_s": 1e10, "bf16_matmul_flop_per_s": 1e12}
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)",
              "torch": torch.__version__, "ceilings": ceil,
              "args": vars(args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1, default=float))

    print(ceil, flush=True)
    for name in args.models:
        try:
            run_model(name, specs[name], args, ceil, result, save)
        except Exception:
            result.setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            print(result[name]["error"], flush=True)
        save()
    for name in args.models:
        for row in result.get(name, {}).get("decode", []):
            if "skipped" in row:
                print(f"{name:18s} ctx={row['context']:6d} B={row['batch']:4d} skipped: {row['skipped']}")
                continue
            print(f"{name:18s} ctx={row['context']:6d} B={row['batch']:4d} engine {row['engine_tok_s']:9.1f} tok/s  "
                  f"gpu {row.get('gpu_tok_s', math.nan):9.1f}  floor {row['floor_tok_s']:9.1f}  "
                  f"frac {row['fraction_of_floor']:.2f} / gpu {row.get('gpu_fraction_of_floor', math.nan):.2f}  "
                  f"wall {row['wall_ms_per_step']:.2f} ms  kernels {row.get('kernel_ms_per_step', math.nan):.2f} ms"
                  f"  floor {row['floor_ms_per_step']:.2f} ms")
        for row in result.get(name, {}).get("transformers", []):
            print(f"{name:18s} B={row['batch']:4d} transformers {row['hf_tok_s']:9.1f} tok/s")
        for p in result.get(name, {}).get("prefill", []):
            print(f"{name:18s} ctx={p['context']:6d} prefill {p['tok_s']:9.0f} tok/s  "
                  f"{p['fraction_of_matmul_rate']:.2f} of matmul rate")
    if args.plot:
        from plot_context import plot

        plot(result, str(out.with_suffix(".png")))
    failures = [f"{name}: {result[name]['error'].splitlines()[-1]}" for name in args.models
                if "MeasurementError" in result.get(name, {}).get("error", "")]
    if failures:
        raise SystemExit("measurement check failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
