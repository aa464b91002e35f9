"""Chat rendering: OpenAI messages -> prompt token ids.

By default the model's Hugging Face chat template renders the conversation. A model family whose prompt
format is not a template (DeepSeek-V4's recipe) registers its own renderer under its HF `model_type` with
`register_chat_renderer`; the server picks it by the checkpoint's config.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Protocol


class ChatRenderer(Protocol):
    def render(self, messages: list[dict], request: dict) -> list[int]:
        """Prompt ids of the conversation, ending where the assistant's reply begins. `request` is the whole
        request body (tools, reasoning options ... for renderers that use them). Bad input: ValueError."""


class HFChatRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], request: dict) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      tools=request.get("tools"))
        except Exception as e:  # jinja raises its own errors, e.g. "roles must alternate user/assistant"
            raise ValueError(f"messages: the chat template rejects the conversation: {e}") from None
        # The template writes the special tokens (BOS included) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)


_RENDERERS: dict[str, Callable[[object, Path], ChatRenderer]] = {}


def register_chat_renderer(model_type: str, factory: Callable[[object, Path], ChatRenderer]) -> None:
    """factory(tokenizer, model_path) -> ChatRenderer, used for checkpoints whose config.json has model_type."""
    _RENDERERS[model_type] = factory


def make_chat_renderer(tokenizer, model_path: Path) -> ChatRenderer:
    config = Path(model_path) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.exists() else None
    factory = _RENDERERS.get(model_type)
    return factory(tokenizer, Path(model_path)) if factory is not None else HFChatRenderer(tokenizer)


def message_text(content) -> str:
    """OpenAI content: a string, or a list of text parts (api_models.TextPart), joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)
