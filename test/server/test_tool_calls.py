"""Tool calls and reasoning through the server, deterministic: a tiny random DeepSeek-V4 checkpoint (no chat
template: deepseek-recipe renders it) whose replies are forced by a regex (our extension) or by the tool-choice
constraint, so parsing is checked on known text; and a named tool choice on SmolLM2 (no known tool format)."""
from __future__ import annotations

import json
import re

import pytest
from conftest import MODEL_NAME
from server_helpers import start_server, stop_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
REPLY = ("Checking the weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
         "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
         "</｜DSML｜tool_calls>")


@pytest.fixture(scope="module")
def v4_client(tiny_v4_path, tmp_path_factory):
    from openai import OpenAI

    log = tmp_path_factory.mktemp("v4") / "server.log"
    proc, url = start_server(tiny_v4_path, log, extra_args=["--kv-cache-tokens", "4096"])
    try:
        assert f"on cpu at {url}" in log.read_text()  # the startup line: model, device, URL
        with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
            yield client
    finally:
        stop_server(proc)


def _thinking(**extra):
    return dict(model="default", messages=MESSAGES, tools=TOOLS, temperature=0,
                extra_body={"chat_template_kwargs": {"thinking": True}, **extra.pop("extra_body", {})}, **extra)


def _streamed(client, **kwargs) -> tuple[str, str, list, str]:
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_v4_recipe_renders_the_prompt(v4_client, tiny_v4_path):
    import deepseek_recipe
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_v4_path))
    cases = [(False, None, {"chat_template_kwargs": {"thinking": False}}),
             (True, None, {"chat_template_kwargs": {"thinking": True}}),
             (False, None, {"reasoning_effort": "none"}), (True, "low", {"reasoning_effort": "low"})]
    for thinking, effort, extra in cases:
        text = deepseek_recipe.DeepseekV4Encoding().render_conversation(deepseek_recipe.Conversation(
            [deepseek_recipe.UserMessage(MESSAGES[0]["content"])], thinking_mode=thinking,
            reasoning_effort=effort)).prompt
        out = v4_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=1, extra_body=extra)
        assert out.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False)), extra


def test_v4_reasoning_and_tool_call_parsed(v4_client):
    kwargs = _thinking(max_tokens=120, extra_body={"regex": re.escape(REPLY)})
    out = v4_client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert message.reasoning_content == "Checking the weather."
    assert message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert out.choices[0].finish_reason == "tool_calls"
    reasoning, content, calls, finish = _streamed(v4_client, **kwargs)
    assert (reasoning, content, finish) == ("Checking the weather.", "", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments), c.index) for c in calls] == \
        [("get_weather", {"city": "Paris"}, 0)]


def test_v4_thinking_off_is_content(v4_client):
    out = v4_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=20, temperature=0,
                                            extra_body={"regex": "Sunny</think>, 20 degrees"})
    message = out.choices[0].message
    assert message.content == "Sunny</think>, 20 degrees" and message.reasoning_content is None


@pytest.fixture(scope="module")
def close_thinking(tiny_v4_path) -> dict[str, float]:
    """logit_bias for a random model under a constraint that starts after its reasoning: </think> pushed, so it
    closes the reasoning at once, and whitespace banned (the JSON grammar allows some between tokens, which a
    random model would fill)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_v4_path))
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    bias = {str(i): -100 for i, text in enumerate(texts) if not text.strip()}
    assert len(bias) < 4096
    bias[str(tok.convert_tokens_to_ids("</think>"))] = 100
    return bias


def test_v4_response_format_after_reasoning(v4_client, close_thinking):
    schema = TOOLS[0]["function"]["parameters"]
    kwargs = _thinking(max_tokens=40, logit_bias=close_thinking, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    kwargs.pop("tools")
    out = v4_client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop", message
    assert json.loads(message.content)["city"] in ("Paris", "Rome")
    assert not message.reasoning_content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_v4_forced_call_after_reasoning(v4_client, close_thinking, tool_choice):
    """The constraint starts after the reasoning block: </think>, then the JSON array of calls."""
    kwargs = _thinking(max_tokens=100, tool_choice=tool_choice, logit_bias=close_thinking,
                       parallel_tool_calls=False)
    out = v4_client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls", message
    assert [(c.function.name, json.loads(c.function.arguments)["city"] in ("Paris", "Rome"))
            for c in message.tool_calls][:1] == [("get_weather", True)]
    assert len(message.tool_calls) == 1  # parallel_tool_calls false
    _, content, calls, finish = _streamed(v4_client, **kwargs)
    assert finish == "tool_calls" and content == ""
    assert [c.function.arguments for c in calls] == [c.function.arguments for c in message.tool_calls]


def test_named_tool_choice_without_a_known_format(client):
    """SmolLM2: no DeepSeek tool format, yet a named choice works through its constraint; 'auto' is refused."""
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**kwargs)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert out.choices[0].finish_reason == "tool_calls"
    _, content, calls, finish = _streamed(client, **kwargs)
    assert [c.function.arguments for c in calls] == [call.function.arguments] and finish == "tool_calls"
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**{**kwargs, "tool_choice": "auto"})
    assert exc.value.body["param"] == "tools"
