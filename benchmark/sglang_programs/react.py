"""ReAct (SGLang's benchmark/react): a few-shot Thought / Action / Observation loop; each Search[...] action is
answered from a small local wiki (data/wiki.json) and appended as the observation, until Finish[...] or the
step limit."""
from __future__ import annotations

import json
import re
import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.harness import DATA, main, read_jsonl

NAME = "react"
MAX_STEPS = 3
WIKI = json.loads((DATA / "wiki.json").read_text())
HEADER = """Solve a question answering task with interleaving Thought, Action, Observation steps. Action is
Search[entity], which returns a sentence about the entity, or Finish[answer], which ends the task.

Question: Which sea is next to the country whose capital is Athens?
Thought 1: I need the country whose capital is Athens.
Action 1: Search[Athens]
Observation 1: Athens is the capital of Greece.
Thought 2: Now I need the sea next to Greece.
Action 2: Search[Greece]
Observation 2: Greece lies on the Mediterranean Sea.
Thought 3: The answer is the Mediterranean Sea.
Action 3: Finish[Mediterranean]

"""


def search(query: str) -> str:
    for key, text in WIKI.items():
        if key.lower() in query.lower() or query.lower() in key.lower():
            return text
    return f"Could not find {query}."


@sgl.function
def program(s, question):
    s += HEADER + "Question: " + question + "\n"
    for step in range(1, MAX_STEPS + 1):
        s += f"Thought {step}:" + sgl.gen(f"thought_{step}", max_tokens=32, stop=["\n", "Action"])
        s += f"\nAction {step}:" + sgl.gen(f"action_{step}", max_tokens=16, stop=["\n", "Observation"])
        action = s[f"action_{step}"]
        finish = re.search(r"Finish\[(.*?)\]", action)
        if finish:
            s["answer"] = finish.group(1)
            return
        query = re.search(r"Search\[(.*?)\]", action)
        s += f"\nObservation {step}: " + (search(query.group(1)) if query else "Invalid action.") + "\n"
    s["answer"] = ""


def load(num_items: int | None = None) -> list[dict]:
    return [{"question": d["question"], "_label": d["answer"]} for d in read_jsonl("react.jsonl", num_items)]


def score(states, items) -> dict:
    hits = sum(item["_label"].lower() in st["answer"].lower() for st, item in zip(states, items) if st["answer"])
    return {"accuracy": hits / len(items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
