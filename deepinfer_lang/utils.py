"""sglang.utils' helpers that frontend programs and benchmarks use: read_jsonl, dump_state_text."""
from __future__ import annotations

import json
import traceback


def read_jsonl(filename: str):
    """The JSON objects of a .jsonl file, one per non-empty line, as a generator."""
    with open(filename) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                yield json.loads(line)


def dump_state_text(filename: str, states, mode: str = "w") -> None:
    """Write each program state's text (or each string) to `filename`, separated by rules."""
    with open(filename, mode) as f:
        for i, s in enumerate(states):
            text = s if isinstance(s, str) else s.text()
            f.write(f"{'=' * 40} {i} {'=' * 40}\n{text}\n")


def get_exception_traceback() -> str:
    return traceback.format_exc()
