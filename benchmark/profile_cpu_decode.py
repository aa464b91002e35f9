"""Where a CPU decode step goes: torch.profiler over decode steps of the embedded default model.

    python benchmark/profile_cpu_decode.py [--dtype float32] [--batch 1] [--steps 16] [--ops 15] [--quantization q4_1]
                                           [--count-ops] [--threads N]

Prompts are prefilled first (one token generated), then `steps` decode steps are profiled. Every module of the
model is wrapped in a profiler scope named by its role (qkv_proj, attention, mlp, ...); the report gives the
step's wall time, each role's share summed over the layers, the host work outside the model (batch building,
sampling, scheduling) and the top aten ops by self time. The CPU step (models/llama_step.py) calls no modules, so
its work shows under "other" and in the op table; --count-ops adds the aten ops one decode step dispatches, per
layer, by the source line they come from (a TorchDispatchMode records the innermost project frame of each op).
"""
from __future__ import annotations

import argparse
import collections
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_rt import Engine, SamplingParams

PROMPT = "Write a short story about topic number {} and the sea, with a lighthouse, a storm and a ship."


def scope_modules(model: torch.nn.Module) -> None:
    """Profiler scope around every module that computes (a leaf or attention's core), named by its role."""
    def enter(mod, _inp):
        mod._scope = record_function(f"role:{mod._role}")
        mod._scope.__enter__()

    def leave(mod, _inp, _out):
        mod._scope.__exit__(None, None, None)

    for name, mod in model.named_modules():
        role = name.rsplit(".", 1)[-1]
        if role in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_layernorm", "post_attention_layernorm",
                    "rotary_emb", "embed_tokens", "norm", "lm_head", "mlp", "self_attn"):
            mod._role = role
            mod.register_forward_pre_hook(enter)
            mod.register_forward_hook(leave)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ops", type=int, default=15)
    ap.add_argument("--quantization", default=None, choices=[None, "int8", "q4_1"])
    ap.add_argument("--count-ops", action="store_true", help="count one decode step's aten ops by source line")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(dtype=args.dtype, kv_cache_tokens=64 * 1024, enable_prefix_cache=False,
                    quantization=args.quantization)
    prompts = [PROMPT.format(i) for i in range(args.batch)]
    runner = engine.executor
    runner.build = _scoped("host:build_batch", runner.build)
    runner.sampler.__call__  # noqa: B018 -- the sampler is called through the runner's attribute
    runner.sampler = _ScopedSampler(runner.sampler)
    scope_modules(engine.model)
    with engine.hold_loop():
        engine.generate(prompts, sampling_params=SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
        reqs = engine.add_request(engine.tokenizer.encode(prompts[0]), SamplingParams(max_new_tokens=1))
        del reqs
        for p in prompts[1:]:
            engine.add_request(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=1))
        sp = SamplingParams(max_new_tokens=args.steps + 1, temperature=0, ignore_eos=True)
        for p in prompts:
            engine.add_request(engine.tokenizer.encode(p), sp)
        while any(len(r.q_lens if hasattr(r, "q_lens") else []) for r in []):
            pass
        engine.step()  # the prefill steps
        while engine.scheduler.waiting:
            engine.step()
        if args.count_ops:
            engine.step()  # a warm decode step first (lazily built state)
            with _OpCounter() as counter:
                engine.step()
            counter.report(engine.model.config.num_layers)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            steps = 0
            while engine.scheduler.running or engine.scheduler.waiting:
                with record_function("step"):
                    engine.step()
                steps += 1
            wall = time.perf_counter() - t
    engine.shutdown()
    totals = collections.Counter()
    ops = []
    for ev in prof.key_averages():
        if ev.key.startswith(("role:", "host:", "step")):
            totals[ev.key] = ev.cpu_time_total / 1e3
        elif ev.key.startswith("aten::"):
            ops.append((ev.self_cpu_time_total / 1e3, ev.count, ev.key))
    step_ms = totals["step"] / steps
    print(f"{args.dtype} batch {args.batch}: {steps} decode steps, {wall / steps * 1e3:.1f} ms/step wall "
          f"({args.batch * steps / wall:.1f} tok/s); profiled {step_ms:.1f} ms/step")
    model_ms = sum(totals[f"role:{r}"] for r in ("embed_tokens", "norm", "lm_head")) / steps
    inner = {r: totals[f"role:{r}"] / steps for r in ("qkv_proj", "rotary_emb", "o_proj", "gate_up_proj",
                                                        "down_proj", "input_layernorm", "post_attention_layernorm")}
    attn_core = (totals["role:self_attn"] - totals["role:qkv_proj"] - totals["role:rotary_emb"]
                 - totals["role:o_proj"]) / steps
    mlp_act = (totals["role:mlp"] - totals["role:gate_up_proj"] - totals["role:down_proj"]) / steps
    rows = {**inner, "attention (store + sdpa + glue)": attn_core, "mlp activation": mlp_act,
            "embed + final norm + lm_head": model_ms, "sampler": totals["host:sampler"] / steps,
            "build_batch (+ backend prepare)": totals["host:build_batch"] / steps}
    rows["other (layer glue, scheduler, output)"] = step_ms - sum(rows.values())
    for name, ms in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {ms:7.2f} ms  {100 * ms / step_ms:5.1f}%")
    print("top aten ops by self time (per step):")
    for ms, count, key in sorted(ops, reverse=True)[: args.ops]:
        print(f"  {key:50s} {ms / steps:7.2f} ms  {count / steps:6.1f} calls")


class _OpCounter(TorchDispatchMode):
    """Aten ops dispatched while active, keyed by (op, innermost deepinfer frame)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/deepinfer" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 2)[-2:][-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        self.counts[(str(func.overloadpacket).split(".")[-1], where)] += 1
        return func(*args, **(kwargs or {}))

    def report(self, num_layers: int) -> None:
        total = sum(self.counts.values())
        print(f"aten ops in one decode step: {total} ({total / num_layers:.1f} per layer); by source line, per layer:")
        by_line = collections.defaultdict(collections.Counter)
        for (op, where), n in self.counts.items():
            by_line[where][op] += n
        for where, ops in sorted(by_line.items(), key=lambda kv: -sum(kv[1].values())):
            n = sum(ops.values())
            detail = ", ".join(f"{op} {c / num_layers:.2f}" for op, c in ops.most_common())
            print(f"  {n / num_layers:6.2f}  {where:45s} {detail}")


def _scoped(name, fn):
    def wrapped(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return wrapped


class _ScopedSampler:
    def __init__(self, sampler):
        self._sampler = sampler

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def __call__(self, *a, **k):
        with record_function("host:sampler"):
            return self._sampler(*a, **k)


if __name__ == "__main__":
    main()
