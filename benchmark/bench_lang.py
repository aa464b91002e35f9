"""deepinfer_lang throughput: few-shot programs through run_batch (prefix cache on) vs the same work issued as
independent Engine.generate requests on an engine without a prefix cache, in one run.

    python benchmark/bench_lang.py [--num-programs 256] [--num-shots 8] [--max-new-tokens 16]

A program: a few-shot header shared by all programs, its own arithmetic question, `select` over four answers
(token_length_normalized), then a short reason (ignore_eos, so both sides generate the same number of tokens).
The baseline sends the same requests to an engine with enable_prefix_cache=False, batched as well as it can be:
one generate scoring every choice of every program (logprobs of the choice tokens after the prompt), then one
generate of every program's reason after its chosen answer. Prints programs/s of both, the speedup and our
prefix-cache hit rate (cached / prompt tokens over all engine requests of the programs); writes
benchmark/results/lang_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

import deepinfer_lang as sgl
from deepinfer_rt import Engine, SamplingParams


def make_question(rng: random.Random) -> tuple[str, list[str], str]:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    answer = str(a + b)
    choices = [answer, str(a + b + rng.randint(1, 9)), str(abs(a - b)), str(a * b)]
    rng.shuffle(choices)
    return f"Question: What is {a} plus {b}?\nAnswer:", [" " + c for c in choices], " " + answer


def make_workload(num_programs: int, num_shots: int, seed: int = 0) -> tuple[str, list[dict]]:
    rng = random.Random(seed)
    header = "Answer each arithmetic question.\n\n" + "".join(
        f"{question}{answer}\n\n" for question, _, answer in (make_question(rng) for _ in range(num_shots)))
    programs = []
    for _ in range(num_programs):
        question, choices, answer = make_question(rng)
        programs.append({"question": question, "choices": choices, "answer": answer})
    return header, programs


@sgl.function
def few_shot(s, header, question, choices, max_new_tokens):
    s += header + question
    s += sgl.select("answer", choices)
    s += "\nBecause" + sgl.gen("reason", max_tokens=max_new_tokens, ignore_eos=True)


def run_ours(backend: sgl.RuntimeBackend, header: str, programs: list[dict], max_new: int) -> tuple[float, list, float]:
    start = time.perf_counter()
    states = few_shot.run_batch([{"header": header, "question": p["question"], "choices": p["choices"],
                                  "max_new_tokens": max_new} for p in programs], backend=backend, temperature=0)
    elapsed = time.perf_counter() - start
    for state in states:
        if state.error() is not None:
            raise RuntimeError(f"a program failed: {state.error()!r}")
    metas = [state.get_meta_info(name) for state in states for name in ("answer", "reason")]
    hit_rate = sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)
    return elapsed, [state["answer"] for state in states], hit_rate


def run_baseline(engine: Engine, header: str, programs: list[dict], max_new: int) -> tuple[float, list]:
    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    start = time.perf_counter()
    prompts = [encode(header + p["question"]) for p in programs]
    choice_ids = [[encode(c) for c in p["choices"]] for p in programs]
    requests = [(prompt, ids) for prompt, choices in zip(prompts, choice_ids) for ids in choices]
    outs = engine.generate(input_ids=[prompt + ids for prompt, ids in requests], sampling_params=[
        SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True, logprob_start_len=len(prompt))
        for prompt, _ in requests])
    means = iter(sum(o.prompt_logprobs[len(prompt):]) / len(ids) for (prompt, ids), o in zip(requests, outs))
    answers = []
    for p in programs:
        scores = [next(means) for _ in p["choices"]]
        answers.append(p["choices"][max(range(len(scores)), key=scores.__getitem__)])
    reason_prompts = [prompt + encode(answer) + encode("\nBecause") for prompt, answer in zip(prompts, answers)]
    engine.generate(input_ids=reason_prompts,
                    sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True))
    return time.perf_counter() - start, answers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-programs", type=int, default=256)
    ap.add_argument("--num-shots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    ours_engine = Engine(args.model, dtype=args.dtype, device=args.device)
    baseline_engine = Engine(args.model, dtype=args.dtype, device=args.device, enable_prefix_cache=False)
    backend = sgl.RuntimeBackend(ours_engine)
    header, programs = make_workload(args.num_programs, args.num_shots)
    warmup_header, warmup = make_workload(2, 1, seed=1)
    run_ours(backend, warmup_header, warmup, 2)
    run_baseline(baseline_engine, warmup_header, warmup, 2)
    ours_engine.flush_cache()

    ours_s, ours_answers, hit_rate = run_ours(backend, header, programs, args.max_new_tokens)
    baseline_s, baseline_answers = run_baseline(baseline_engine, header, programs, args.max_new_tokens)
    n = len(programs)
    result = {
        "benchmark": "lang", "model": args.model, "device": args.device, "dtype": args.dtype, "num_programs": n,
        "num_shots": args.num_shots, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "ours_programs_s": n / ours_s, "baseline_programs_s": n / baseline_s, "speedup": baseline_s / ours_s,
        "hit_rate": hit_rate,
        "answers_agree": sum(a == b for a, b in zip(ours_answers, baseline_answers)) / n,
        "accuracy": sum(a == p["answer"] for a, p in zip(ours_answers, programs)) / n,
    }
    print(f"deepinfer_lang run_batch {result['ours_programs_s']:.2f} programs/s | independent generate, no prefix "
          f"cache {result['baseline_programs_s']:.2f} programs/s | speedup {result['speedup']:.2f}x | cache hit rate "
          f"{hit_rate:.1%} | answers agree {result['answers_agree']:.0%} | accuracy {result['accuracy']:.0%}")
    out = Path(args.out or Path(__file__).parent / "results" / f"lang_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
