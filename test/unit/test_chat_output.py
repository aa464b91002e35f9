"""The chat output parser: reasoning / content / tool calls of DeepSeek V3, V3.1, V3.2, V4 and V4.1 outputs. V4 and
V4.1 outputs are what deepseek-recipe renders for an assistant turn (its own encoder), so the parser reads the format
the checkpoints were trained on; any split of the text into stream deltas parses the same as the whole."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from deepinfer_rt.server.chat_output import ChatOutputParser, ParsedDelta, parse_json_calls

CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("lookup", {"q": "a \"quoted\" <b>", "tags": ["x", 1]})]


def _recipe_output(encoding: str, content: str, reasoning: str) -> str:
    """The assistant turn as the recipe renders it in history, after the prompt's `<think>`."""
    recipe = pytest.importorskip("deepseek_recipe")
    tools = [recipe.ToolDefinition(name, None, {"type": "object"}) for name, _ in CALLS]
    calls = [recipe.ToolCall(f"c{i}", name, json.dumps(args)) for i, (name, args) in enumerate(CALLS)]
    messages = [recipe.UserMessage("hi"), recipe.AssistantMessage(content, reasoning_content=reasoning,
                                                                 tool_calls=calls),
                recipe.UserMessage("next")]
    text = getattr(recipe, encoding)().render_conversation(
        recipe.Conversation(messages, thinking_mode=True, tools=tools)).prompt
    turn = text.split("<｜User｜>hi<｜Assistant｜>", 1)[1].split("<｜end▁of▁sentence｜>", 1)[0]
    assert turn.startswith("<think>")
    return turn[len("<think>"):]


def _v3_output(style: str) -> str:
    calls = []
    for name, args in CALLS:
        if style == "v3":
            calls.append(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```"
                         "<｜tool▁call▁end｜>")
        else:
            calls.append(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>")
    return "Thinking it over.</think>Let me look.\n\n<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>"


def _v32_output() -> str:
    invokes = []
    for name, args in CALLS:
        params = "".join(f'<｜DSML｜parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
                         f'{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n' for k, v in args.items())
        invokes.append(f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>\n')
    return "Thinking it over.</think>Let me look.\n\n<｜DSML｜function_calls>\n" + "".join(invokes) + \
        "</｜DSML｜function_calls>"


OUTPUTS = {
    "v3": ("deepseek_v3", lambda: _v3_output("v3")),
    "v3.1": ("deepseek_v3", lambda: _v3_output("v31")),
    "v3.2": ("dsml", _v32_output),
    "v4": ("dsml", lambda: _recipe_output("DeepseekV4Encoding", "Let me look.", "Thinking it over.")),
    "v4.1": ("dsml", lambda: _recipe_output("DeepseekV41Encoding", "Let me look.", "Thinking it over.")),
}


def _parse(fmt: str, pieces, starts_in_reasoning=True) -> ParsedDelta:
    parser, out = ChatOutputParser(fmt, starts_in_reasoning), ParsedDelta()
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    return out


@pytest.mark.parametrize("version", list(OUTPUTS))
def test_reasoning_content_and_calls(version):
    fmt, make = OUTPUTS[version]
    out = _parse(fmt, [make()])
    assert out.reasoning == "Thinking it over."
    assert out.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == CALLS
    assert len({c.id for c in out.tool_calls}) == len(CALLS)


@settings(max_examples=60, deadline=None)
@given(version=st.sampled_from(list(OUTPUTS)), cuts=st.lists(st.integers(0, 2000), max_size=30))
def test_any_stream_split_parses_like_the_whole(version, cuts):
    fmt, make = OUTPUTS[version]
    text = make()
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole, split = _parse(fmt, [text]), _parse(fmt, pieces)
    assert (split.reasoning, split.content) == (whole.reasoning, whole.content)
    assert [(c.name, c.arguments) for c in split.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_one_char_at_a_time():
    text = _v32_output()
    out = _parse("dsml", list(text))
    assert out.content == "Let me look." and len(out.tool_calls) == 2


def test_thinking_off_and_think_block_in_output():
    assert _parse("dsml", ["The answer is 4."], starts_in_reasoning=False).content == "The answer is 4."
    out = _parse(None, ["<think>", "hmm</th", "ink>\n\nFour."], starts_in_reasoning=False)
    assert (out.reasoning, out.content) == ("hmm", "Four.")


def test_unclosed_reasoning_and_unfinished_call_block():
    assert _parse("dsml", ["still thinking"]).reasoning == "still thinking"
    out = _parse("deepseek_v3", ["x</think>Hi <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"])
    assert out.tool_calls == [] and out.content.startswith("Hi") and "<｜tool▁call▁begin｜>" in out.content


def test_text_that_only_looks_like_a_marker_prefix_is_content():
    out = _parse("dsml", ["a <｜DS", "ML is not a call"], starts_in_reasoning=False)
    assert out.content == "a <｜DSML is not a call" and out.tool_calls == []


def test_parse_json_calls():
    calls = parse_json_calls('[{"name": "f", "arguments": {"a": 1}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
