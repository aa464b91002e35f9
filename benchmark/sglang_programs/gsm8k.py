"""Few-shot GSM8K (SGLang's benchmark/gsm8k): k solved examples, then the question; the answer is generated until
the next "Question" and its final number is compared with the reference. Every program shares the few-shot
header, which the prefix cache computes once."""
from __future__ import annotations

import re
import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.harness import main, read_jsonl

NAME = "gsm8k"
NUM_SHOTS = 4


def number_in(text: str) -> str | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return numbers[-1] if numbers else None


@sgl.function
def program(s, few_shot, question):
    s += few_shot + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=64, stop=["Question", "\n\n"])


def load(num_items: int | None = None) -> list[dict]:
    data = read_jsonl("gsm8k.jsonl")
    shots, tests = data[:NUM_SHOTS], data[NUM_SHOTS:]
    few_shot = "".join(f"Question: {d['question']}\nAnswer: {d['answer']}\n\n" for d in shots)
    tests = tests[:num_items] if num_items else tests
    return [{"few_shot": few_shot, "question": d["question"], "_label": number_in(d["answer"])} for d in tests]


def score(states, items) -> dict:
    preds = [number_in(st["answer"].split("####")[-1]) for st in states]
    return {"accuracy": sum(p == item["_label"] for p, item in zip(preds, items)) / len(items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
