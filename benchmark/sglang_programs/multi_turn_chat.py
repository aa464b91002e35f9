"""Multi-turn chat (SGLang's benchmark/multi_turn_chat): each conversation appends a user turn and generates the
assistant's reply, turn after turn; each turn's prompt extends the previous one, so the prefix cache serves the
history and only the new turn is computed."""
from __future__ import annotations

import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.harness import main, read_jsonl

NAME = "multi_turn_chat"


@sgl.function
def program(s, turns):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"reply_{i}", max_tokens=32))


def load(num_items: int | None = None) -> list[dict]:
    return [{"turns": d["turns"]} for d in read_jsonl("chats.jsonl", num_items)]


def score(states, items) -> dict:
    return {"turns": sum(len(item["turns"]) for item in items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
