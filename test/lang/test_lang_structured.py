"""Constrained gens (regex, int, string, JSON schema). All depend on the engine's structured output."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

import deepinfer_lang as sgl


def test_gen_int_is_an_integer(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Pick a number:" + sgl.gen_int("n", max_tokens=6)

    value = prog.run(backend=tiny_backend, temperature=0)["n"]
    assert re.fullmatch(r"[-+]?[0-9]+", value), value
    int(value)


def test_regex_gen_matches(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Answer and code:" + sgl.gen("v", max_tokens=16, regex=r"(yes|no), [0-9]{3}")

    state = prog.run(backend=tiny_backend, temperature=0)
    assert re.fullmatch(r"(yes|no), [0-9]{3}", state["v"]), state["v"]
    assert state.get_meta_info("v")["finish_reason"] == "stop"


def test_a_schema_the_engine_rejects_names_the_gen(tiny_backend):
    @sgl.function
    def prog(s):
        s += "JSON:" + sgl.gen("bad", max_tokens=4, json_schema="{not json")

    with pytest.raises(ValueError, match="gen 'bad' in program 'prog'"):
        prog.run(backend=tiny_backend)


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_engine):
    return sgl.RuntimeBackend(smollm2_engine)


def test_json_schema_gen_parses(smollm2_backend):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    @sgl.function
    def person(s):
        s += sgl.user("Describe Ana, who is 31 years old, as a JSON object with her name and age.")
        s += sgl.assistant(sgl.gen("person", max_tokens=48, json_schema=schema))

    state = person.run(backend=smollm2_backend, temperature=0)
    jsonschema.validate(json.loads(state["person"]), schema)


def test_gen_string_is_a_quoted_string(smollm2_backend):
    @sgl.function
    def color(s):
        s += "Q: Name a primary color.\nA: " + sgl.gen_string("color", max_tokens=8)

    value = color.run(backend=smollm2_backend, temperature=0)["color"]
    assert re.fullmatch(r'"[\w\d\s]*"', value), value
