"""Structured extraction on the embedded default model: one JSON record per sentence, valid by construction.

    python examples/extract_json.py [--data examples/data/people.jsonl]

A generation program (deepinfer_lang) run over the dataset with run_batch: each line of the data file is
{"text": ..., "expected": {...}}; the program puts the instruction and the text in chat roles and generates the
assistant's answer under a JSON schema (greedy), so every answer parses and validates. Whether the fields are
right is up to the model (a 135M one gets most, not all); the summary counts both.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema

import deepinfer_lang as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "minLength": 1, "maxLength": 40},
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
    },
    "required": ["name", "age", "occupation", "city"],
}
INSTRUCTION = ("Extract the person described in the text as a JSON object with the keys name, age (a number), "
               "occupation and city.")


def same(a, b) -> bool:
    return a.casefold() == b.casefold() if isinstance(a, str) and isinstance(b, str) else a == b


@sgl.function
def extract(s, text):
    s += sgl.system(INSTRUCTION)
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("record", max_tokens=96, temperature=0, json_schema=SCHEMA))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).parent / "data" / "people.jsonl"))
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]

    with sgl.Runtime(model="smollm2-135m-instruct") as runtime:
        states = extract.run_batch([{"text": r["text"]} for r in rows], backend=runtime, progress_bar=False)
    valid = right = 0
    for row, state in zip(rows, states):
        text = state["record"]
        try:
            record = json.loads(text)
            jsonschema.validate(record, SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"INVALID ({state.get_meta_info('record')['finish_reason']}): {text!r}: {e}")
            continue
        valid += 1
        right += sum(same(record[k], v) for k, v in row["expected"].items())
        print(json.dumps(record))
    fields = sum(len(r["expected"]) for r in rows)
    print(f"{valid}/{len(rows)} records valid against the schema; {right}/{fields} fields as expected "
          "(ignoring case)")


if __name__ == "__main__":
    main()
