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
"""
from __future__ import annotations

_SENTINEL = "<<deepinfer-lang-role-content>>"


class ChatTemplate:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.has_template = getattr(tokenizer, "chat_template", None) is not None

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
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja raises its own errors, e.g. "roles must alternate user/assistant"
            raise ValueError(f"{messages[-1]['role']} role: the chat template rejects the conversation: {e}") from e
