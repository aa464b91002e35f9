"""Parallel sampling (SGLang's parallel-sample programs): fork the prompt into n branches that sample at a
temperature together, join with gather_variable, and let select pick the best candidate."""
from __future__ import annotations

import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.harness import main, read_jsonl

NAME = "parallel_sampling"
NUM_SAMPLES = 4


@sgl.function
def program(s, prompt):
    s += sgl.user(prompt)
    forks = s.fork(NUM_SAMPLES)
    forks += sgl.assistant(sgl.gen("candidate", max_tokens=24, temperature=0.8, stop="\n"))
    forks.join()
    candidates = [c.strip() or "(empty)" for c in s["candidate"]]
    s += sgl.user("Which of these is best? " + " / ".join(candidates))
    s += sgl.assistant(sgl.select("best", choices=list(dict.fromkeys(candidates))))


def load(num_items: int | None = None) -> list[dict]:
    return [{"prompt": d["prompt"]} for d in read_jsonl("prompts.jsonl", num_items)]


def score(states, items) -> dict:
    return {"distinct_per_prompt": sum(len(set(st["candidate"])) for st in states) / len(items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
