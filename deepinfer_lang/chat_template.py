"""Role text from the tokenizer's chat template.

A role's text is what the template adds when one message of that role is appended to the conversation so far.
Rendering that message with a sentinel as its content splits the addition into the part before the content
(appended at role begin) and the part after it (appended at role end). So a program made of roles ends with
exactly tokenizer.apply_chat_template(state.messages(), tokenize=False), including text the template adds on
its own, such as SmolLM2's default system message when the first message is not a system one.

This needs a template that renders earlier turns the same whatever follows them (ChatML, Llama, SmolLM2 and
most others do); one that rewrites earlier turns (e.g. drops reasoning from past assistant turns) cannot be
followed by an append-only prompt and is refused with a ValueError.

A tokenizer without a chat template renders a role as plain "role: content\\n".

DeepSeek-V4 models ship no Jinja template: their prompts are rendered by PyPI `deepseek-recipe`
(`recipe="deepseek_v4"` or `"deepseek_v41"`, non-thinking mode). The recipe always ends a rendering with the
assistant generation prompt; it is stripped, so roles append exactly as with a Jinja template.
"""
from __future__ import annotations

_SENTINEL = "<<deepinfer-lang-role-content>>"


_RECIPES = {"deepseek_v4": "DeepseekV4Encoding", "deepseek_v41": "DeepseekV41Encoding"}


class _RecipeRenderer:
    """messages -> prompt text through a deepseek-recipe encoding, without the trailing generation prompt."""

    def __init__(self, recipe: str):
        import deepseek_recipe

        if recipe not in _RECIPES:
            raise ValueError(f"recipe must be one of {sorted(_RECIPES)}, got {recipe!r}")
        self.lib = deepseek_recipe
        self.encoding = getattr(deepseek_recipe, _RECIPES[recipe])()
        self.generation_prompt = self._render_all([{"role": "user", "content": _SENTINEL}]).split(_SENTINEL)[1]

    def _render_all(self, messages: list[dict]) -> str:
        kinds = {"system": self.lib.SystemMessage, "user": self.lib.UserMessage,
                 "assistant": self.lib.AssistantMessage}
        if any(m["role"] not in kinds for m in messages):
            raise ValueError(f"roles must be in {sorted(kinds)}, got {[m['role'] for m in messages]}")
        conversation = self.lib.Conversation([kinds[m["role"]](m["content"]) for m in messages],
                                             thinking_mode=False)
        return self.encoding.render_conversation(conversation).prompt

    def __call__(self, messages: list[dict]) -> str:
        return self._render_all(messages).removesuffix(self.generation_prompt)


class ChatTemplate:
    def __init__(self, tokenizer, recipe: str | None = None):
        self.tokenizer = tokenizer
        self.recipe = _RecipeRenderer(recipe) if recipe is not None else None
        self.has_template = self.recipe is not None or getattr(tokenizer, "chat_template", None) is not None

    def role_segments(self, messages: list[dict], role: str) -> tuple[str, str]:
        """(text before the content, text after it) of a `role` message appended to `messages`."""
        if not self.has_template:
            return f"{role}: ", "\n"
        before = self._render(messages)
        after = self._render(messages + [{"role": role, "content": _SENTINEL}])
        if not after.startswith(before) or after.count(_SENTINEL) != 1:
            raise ValueError(f"{role} role: the chat template re-renders earlier turns when a message is added, so "
                             f"an append-only program cannot follow it")
        begin, end = after[len(before):].split(_SENTINEL)
        return begin, end

    def _render(self, messages: list[dict]) -> str:
        # The empty conversation renders as "": whatever a template puts before its first message (a BOS, a
        # default system message) then belongs to the first role's begin text, where the program's text needs it.
        if not messages:
            return ""
        try:
            if self.recipe is not None:
                return self.recipe(messages)
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja raises its own errors, e.g. "roles must alternate user/assistant"
            raise ValueError(f"{messages[-1]['role']} role: the chat template rejects the conversation: {e}") from e
