"""Tree of thought (SGLang's benchmark/tree_of_thought_gsm8k): propose several plans for a question, expand each
into solutions, let the model judge each solution, and pick the answer of the best one. Every level forks the
state, so the branches run together on a prompt computed once."""
from __future__ import annotations

import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.gsm8k import number_in
from benchmark.sglang_programs.harness import main, read_jsonl

NAME = "tree_of_thought"
NUM_PLANS = 2
NUM_SOLUTIONS = 2
TEMPERATURE = 0.7


@sgl.function
def program(s, question):
    s += sgl.user("Solve the math problem step by step. " + question)
    plans = s.fork(NUM_PLANS)
    plans += sgl.assistant_begin()
    plans += "Plan:" + sgl.gen("plan", max_tokens=32, stop="\n", temperature=TEMPERATURE)
    solutions = []
    for plan in plans:
        forks = plan.fork(NUM_SOLUTIONS)
        forks += lambda i: f"\nSolution {i + 1}:" + sgl.gen("solution", max_tokens=48, temperature=TEMPERATURE)
        forks += sgl.assistant_end()
        forks += sgl.user("Is this solution correct? Answer yes or no.")
        forks += sgl.assistant(sgl.select("judgement", choices=["yes", "no"]))
        solutions += list(forks)
        forks.join()
    plans.join()
    best = [f for f in solutions if f["judgement"] == "yes"] or solutions
    s["answer"] = number_in(best[0]["solution"]) or ""


def load(num_items: int | None = None) -> list[dict]:
    data = read_jsonl("gsm8k.jsonl")
    data = data[:num_items] if num_items else data
    return [{"question": d["question"], "_label": number_in(d["answer"])} for d in data]


def score(states, items) -> dict:
    return {"accuracy": sum(st["answer"] == item["_label"] for st, item in zip(states, items)) / len(items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
