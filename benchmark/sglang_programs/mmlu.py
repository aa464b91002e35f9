"""MMLU-style multiple choice (SGLang's benchmark/mmlu, hellaswag): a few-shot header of answered questions of
the subject, then the question and its lettered choices; `select` picks the letter by the model's logprobs."""
from __future__ import annotations

import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.harness import main, read_jsonl

NAME = "mmlu"
NUM_SHOTS = 3
LETTERS = ["A", "B", "C", "D"]


def format_question(d: dict, with_answer: bool) -> str:
    text = d["question"] + "\n" + "".join(f"{l}. {c}\n" for l, c in zip(LETTERS, d["choices"])) + "Answer:"
    return text + (f" {d['answer']}\n\n" if with_answer else "")


@sgl.function
def program(s, header, question):
    s += header + question
    s += sgl.select("answer", choices=[" A", " B", " C", " D"])


def load(num_items: int | None = None) -> list[dict]:
    data = read_jsonl("mmlu.jsonl")
    shots, tests = data[:NUM_SHOTS], data[NUM_SHOTS:]
    header = ("The following are multiple choice questions (with answers).\n\n"
              + "".join(format_question(d, True) for d in shots))
    tests = tests[:num_items] if num_items else tests
    return [{"header": header, "question": format_question(d, False), "_label": d["answer"]} for d in tests]


def score(states, items) -> dict:
    return {"accuracy": sum(st["answer"].strip() == item["_label"] for st, item in zip(states, items)) / len(items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
