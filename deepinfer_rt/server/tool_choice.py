"""Constraints of a chat reply: `tool_choice` 'required' or a named function, and structured output after the
reasoning block.

A required or named choice constrains the reply to a JSON array of calls, `[{"name": ..., "arguments": {...}}]`,
each call's arguments following its tool's parameters schema (one call for a named choice or
parallel_tool_calls=false); the server turns that array into tool_calls. When the prompt opened a thinking block,
a JSON constraint (that one, or response_format's) starts after the reasoning: the reply is free text without
`</think>`, then `</think>`, then the JSON.
"""
from __future__ import annotations

import json

_THINK_END = "</think>"


def calls_schema(tools: list[dict], tool_choice, parallel_tool_calls: bool) -> dict:
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    options = []
    for tool in tools:
        fn = tool["function"]
        if named is not None and fn["name"] != named:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if named is not None or not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _reasoning_rules() -> str:
    """EBNF of any text not containing `</think>`: rule rK holds after matching its first K characters."""
    rules = ['r0 ::= "" | [^<] r0 | "<" r1']
    for k in range(1, len(_THINK_END)):
        c = _THINK_END[k]
        alts = ['""', '"<" r1']
        if k + 1 < len(_THINK_END):
            alts.append(f'"{c}" r{k + 1}')
        alts.append(f"[^<{c}] r0")
        rules.append(f"r{k} ::= " + " | ".join(alts))
    return "\n".join(rules)


def after_reasoning(schema_text: str) -> str:
    """EBNF: reasoning, `</think>`, newlines, then JSON following schema_text."""
    import xgrammar

    from deepinfer_rt.constrained.grammar import _json_schema_grammar  # the engine's JSON grammar, same options

    reasoning = xgrammar.Grammar.from_ebnf(f'root ::= r0 "{_THINK_END}" [\\n]*\n' + _reasoning_rules())
    try:
        json_grammar = _json_schema_grammar(schema_text)
    except RuntimeError as e:
        raise ValueError(f"response_format: the schema cannot be compiled: {e}") from None
    return str(xgrammar.Grammar.concat(reasoning, json_grammar))


def is_forced_call(tool_choice) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, dict)


def reply_constraint(request: dict, constraint_fields: dict, starts_in_reasoning: bool) -> dict:
    """regex / json_schema / ebnf for the reply's SamplingParams. `request` is the body as a dict."""
    fields = dict(constraint_fields)
    if is_forced_call(request.get("tool_choice")):
        if any(v is not None for v in fields.values()):
            raise ValueError("tool_choice: a required tool call cannot be combined with regex / ebnf / "
                             "response_format")
        fields = {"json_schema": json.dumps(calls_schema(request["tools"], request["tool_choice"],
                                                         request.get("parallel_tool_calls", True)))}
    schema = fields.get("json_schema")
    if starts_in_reasoning and schema is not None:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        fields = {"ebnf": after_reasoning(text)}
    return fields
