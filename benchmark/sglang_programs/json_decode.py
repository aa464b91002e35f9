"""JSON decoding (SGLang's benchmark/json_decode_regex): describe a city as JSON whose shape a regex fixes (the
keys and punctuation are forced, the values generated), then check each output parses."""
from __future__ import annotations

import json
import sys

import deepinfer_lang as sgl
from benchmark.sglang_programs.harness import main, read_jsonl
from deepinfer_lang.lang.ir import REGEX_INT

NAME = "json_decode"
STR = r'"[\w\d\s]{1,16}"'
CITY_REGEX = (r"\{\n" + r'  "name": ' + STR + r",\n" + r'  "country": ' + STR + r",\n"
              + r'  "population": ' + r"[0-9]{1,9}" + r",\n" + r'  "top_3_landmarks": \[' + STR + r", " + STR
              + r", " + STR + r"\]\n" + r"\}")


@sgl.function
def program(s, city):
    s += sgl.user(f"Please describe the city {city} in JSON.")
    s += sgl.assistant_begin()
    s += sgl.gen("json", max_tokens=96, regex=CITY_REGEX)
    s += sgl.assistant_end()
    s += sgl.user("How many people live there, as a number?")
    s += sgl.assistant(sgl.gen("population", max_tokens=8, regex=REGEX_INT.rstrip("[ \\n]*")))


def load(num_items: int | None = None) -> list[dict]:
    return [{"city": d["city"]} for d in read_jsonl("cities.jsonl", num_items)]


def score(states, items) -> dict:
    def parses(text: str) -> bool:
        try:
            return isinstance(json.loads(text), dict)
        except json.JSONDecodeError:
            return False

    return {"valid_json": sum(parses(st["json"]) for st in states) / len(items)}


if __name__ == "__main__":
    main([sys.modules[__name__]])
