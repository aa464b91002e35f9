"""Structured extraction on the embedded default model: one JSON record per sentence, valid by construction.

    python examples/extract_json.py [--data examples/data/people.jsonl]

Each line of the data file is {"text": ..., "expected": {...}}. The model reads the text in a chat prompt and
answers under a JSON schema (greedy), so every answer parses and validates; whether the fields are right is
up to the model (a 135M one gets most, not all), and the summary counts both.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema

from deepinfer_rt import Engine, SamplingParams

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


def prompt(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}],
        tokenize=False, add_generation_prompt=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).parent / "data" / "people.jsonl"))
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]

    with Engine("smollm2-135m-instruct") as engine:
        outs = engine.generate([prompt(engine, r["text"]) for r in rows],
                               sampling_params=SamplingParams(temperature=0, max_new_tokens=96, json_schema=SCHEMA))
    valid = right = 0
    for row, out in zip(rows, outs):
        try:
            record = json.loads(out.text)
            jsonschema.validate(record, SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"INVALID ({out.finish_reason}): {out.text!r}: {e}")
            continue
        valid += 1
        right += sum(same(record[k], v) for k, v in row["expected"].items())
        print(json.dumps(record))
    fields = sum(len(r["expected"]) for r in rows)
    print(f"{valid}/{len(rows)} records valid against the schema; {right}/{fields} fields as expected "
          "(ignoring case)")


if __name__ == "__main__":
    main()
