"""Chat rendering: OpenAI messages -> prompt token ids, and how the model's reply is to be read.

By default the model's Hugging Face chat template renders the conversation. A model family whose prompt
format is not a template registers its own renderer under its HF `model_type` with `register_chat_renderer`; it is
used for checkpoints of that type whose tokenizer has no chat template. DeepSeek-V4 checkpoints ship none: PyPI
deepseek-recipe renders them (V4's or V4.1's encoding by the checkpoint's model_type; chat_encoding forces one).

Thinking: `chat_template_kwargs` reach the template as given; `reasoning_effort` sets `thinking` and
`enable_thinking` (the names DeepSeek's and Qwen's templates read) unless those kwargs set them: "none" off, any
other effort on. A reply starts in reasoning when the rendered prompt ends inside an opened `<think>` block.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from deepinfer_rt.server.chat_output import THINK_START


@dataclass(frozen=True)
class RenderedChat:
    ids: list[int]
    starts_in_reasoning: bool
    """The prompt opened a thinking block: the reply is reasoning until `</think>`."""


class ChatRenderer(Protocol):
    def render(self, messages: list[dict], request: dict) -> RenderedChat:
        """The conversation, ending where the assistant's reply begins. `request` is the whole request body
        (tools, tool_choice, chat_template_kwargs, reasoning_effort). Bad input: ValueError."""


def thinking_kwargs(request: dict) -> dict:
    kwargs = dict(request.get("chat_template_kwargs") or {})
    effort = request.get("reasoning_effort")
    if effort is not None:
        is_on = effort != "none"
        kwargs.setdefault("thinking", is_on)
        kwargs.setdefault("enable_thinking", is_on)
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def prompt_tools(request: dict) -> list[dict] | None:
    """The tools the prompt lists: none with tool_choice 'none' (the model is not to call any)."""
    return None if request.get("tool_choice") == "none" else request.get("tools")


def _starts_in_reasoning(text: str) -> bool:
    return text.rstrip().endswith(THINK_START)


class HFChatRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], request: dict) -> RenderedChat:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        kwargs = thinking_kwargs(request)
        for reserved in ("tokenize", "add_generation_prompt", "tools", "conversation"):
            if reserved in kwargs:
                raise ValueError(f"chat_template_kwargs: {reserved!r} is set by the server")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      tools=prompt_tools(request), **kwargs)
        except Exception as e:  # jinja raises its own errors, e.g. "roles must alternate user/assistant"
            raise ValueError(f"messages: the chat template rejects the conversation: {e}") from None
        # The template writes the special tokens (BOS included) itself.
        return RenderedChat(self.tokenizer.encode(text, add_special_tokens=False), _starts_in_reasoning(text))


_RECIPE_EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "max": "max"}
"""OpenAI's efforts -> the recipe's (low, high, xhigh, max)."""


class RecipeChatRenderer:
    """DeepSeek-V4 / V4.1 prompts through deepseek-recipe's encoders. Thinking is off unless chat_template_kwargs
    ({"thinking": true}) or a reasoning_effort other than "none" turns it on."""

    def __init__(self, tokenizer, encoding: str = "DeepseekV4Encoding"):
        import deepseek_recipe

        self.lib = deepseek_recipe
        self.tokenizer = tokenizer
        self.encoding = getattr(deepseek_recipe, encoding)()

    def _message(self, m: dict):
        lib, content = self.lib, m.get("content") or ""
        role = m["role"]
        if role in ("system", "developer"):
            return lib.SystemMessage(content)
        if role == "user":
            return lib.UserMessage(content)
        if role == "tool":
            return lib.ToolMessage(content, m.get("tool_call_id"))
        calls = [lib.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in m.get("tool_calls") or ()]
        return lib.AssistantMessage(content, reasoning_content=m.get("reasoning_content"), tool_calls=calls or None)

    def render(self, messages: list[dict], request: dict) -> RenderedChat:
        kwargs = thinking_kwargs(request)
        unknown = set(kwargs) - {"thinking", "enable_thinking", "reasoning_effort"}
        if unknown:
            raise ValueError(f"chat_template_kwargs: {sorted(unknown)[0]!r} is not a DeepSeek-V4 option "
                             "(thinking, reasoning_effort)")
        is_thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
        effort = request.get("reasoning_effort")
        tools = [self.lib.ToolDefinition(t["function"]["name"], t["function"].get("description"),
                                         t["function"].get("parameters"), t["function"].get("strict"))
                 for t in prompt_tools(request) or ()]
        try:
            conversation = self.lib.Conversation(
                [self._message(m) for m in messages], thinking_mode=is_thinking, tools=tools or None,
                # required / named choices are enforced by a constraint on the reply, not by the prompt
                tool_choice="none" if request.get("tool_choice") == "none" else "auto",
                reasoning_effort=_RECIPE_EFFORTS.get(effort) if is_thinking and effort else None)
            text = self.encoding.render_conversation(conversation).prompt
        except (ValueError, TypeError, self.lib.ConversionError) as e:
            raise ValueError(f"messages: the DeepSeek recipe rejects the conversation: {e}") from None
        return RenderedChat(self.tokenizer.encode(text, add_special_tokens=False), _starts_in_reasoning(text))


_RENDERERS: dict[str, Callable[[object, Path], ChatRenderer]] = {}


def register_chat_renderer(model_type: str, factory: Callable[[object, Path], ChatRenderer]) -> None:
    """factory(tokenizer, model_path) -> ChatRenderer, used for checkpoints of model_type without a template."""
    _RENDERERS[model_type] = factory


register_chat_renderer("deepseek_v4", lambda tokenizer, path: RecipeChatRenderer(tokenizer))
register_chat_renderer("deepseek_v41", lambda tokenizer, path: RecipeChatRenderer(tokenizer, "DeepseekV41Encoding"))

_ENCODINGS = {"deepseek_v4": "DeepseekV4Encoding", "deepseek_v41": "DeepseekV41Encoding"}


@dataclass(frozen=True)
class ChatFormat:
    """How one model's chats are rendered and its replies read."""
    renderer: ChatRenderer
    tool_format: str | None
    """chat_output.TOOL_FORMATS key, or None: the model's tool-call text is not known (tool_choice 'auto' with
    tools is refused; 'required' and named choices work through their constraint)."""
    is_reasoning_model: bool
    """Replies may open with a <think> block."""


def _model_type(model_path: Path) -> str | None:
    config = Path(model_path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.exists() else None


def make_chat_format(tokenizer, model_path: Path, tool_call_parser: str | None = None,
                     chat_encoding: str | None = None) -> ChatFormat:
    """tool_call_parser: 'deepseek_v3' | 'dsml' | 'none' | None (by the checkpoint: DeepSeek V3/V3.1 templates
    -> deepseek_v3, V3.2 (DSML in its template) and V4 -> dsml). chat_encoding: 'deepseek_v4' | 'deepseek_v41'
    forces the recipe renderer."""
    model_type = _model_type(model_path)
    template = getattr(tokenizer, "chat_template", None) or ""
    if chat_encoding is not None:
        if chat_encoding not in _ENCODINGS:
            raise ValueError(f"chat_encoding must be one of {sorted(_ENCODINGS)}, got {chat_encoding!r}")
        renderer: ChatRenderer = RecipeChatRenderer(tokenizer, _ENCODINGS[chat_encoding])
    elif not template and model_type in _RENDERERS:
        renderer = _RENDERERS[model_type](tokenizer, Path(model_path))
    else:
        renderer = HFChatRenderer(tokenizer)
    is_deepseek = (model_type or "").startswith("deepseek")
    if tool_call_parser is None:
        if isinstance(renderer, RecipeChatRenderer) or "DSML" in template:
            tool_call_parser = "dsml"
        elif is_deepseek and "tool▁calls▁begin" in template:
            tool_call_parser = "deepseek_v3"
    tool_format = None if tool_call_parser in (None, "none") else tool_call_parser
    return ChatFormat(renderer, tool_format, is_deepseek or THINK_START in template)


def message_text(content) -> str:
    """OpenAI content: a string, or a list of text parts (api_models.TextPart), joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)
