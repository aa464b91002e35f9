"""Fixed role templates by name (SGLang's sglang.lang.chat_template): ChatTemplate, a registry, matching by model
path. Our backends render roles from the tokenizer's own chat template (deepinfer_lang.chat_template); a named
template is used instead when a backend is built with chat_template_name= (RuntimeBackend, Runtime,
RuntimeEndpoint), as SGLang's RuntimeEndpoint(chat_template_name=...) does."""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable


class ChatTemplateStyle(Enum):
    PLAIN = auto()
    LLAMA2 = auto()


@dataclass
class ChatTemplate:
    name: str
    default_system_prompt: str | None
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] | list[str] = ()
    image_token: str = "<image>"
    audio_token: str = "<audio>"
    style: ChatTemplateStyle = ChatTemplateStyle.PLAIN

    has_template = True  # for the interpreter: roles come from this template

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        prefix, suffix = self.role_prefix_and_suffix.get(role, ("", ""))
        if self.style == ChatTemplateStyle.LLAMA2:
            # Llama 2 puts the system message inside the first [INST] block.
            if role == "system" and not hist_messages:
                user_prefix = self.role_prefix_and_suffix.get("user", ("", ""))[0]
                return user_prefix + prefix, suffix
            if role == "user" and len(hist_messages) == 1 and hist_messages[0]["content"] is not None:
                return "", suffix
        return prefix, suffix

    def get_prompt(self, messages: list[dict]) -> str:
        prompt = ""
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(role, messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt

    def role_segments(self, messages: list[dict], role: str) -> tuple[str, str]:
        """The interpreter's view: (text before the content, text after it). The first role of a conversation,
        when not a system one, is preceded by the template's default system message (as SGLang inserts it)."""
        prefix, suffix = self.get_prefix_and_suffix(role, messages)
        if not messages and role != "system" and self.default_system_prompt:
            sys_prefix, sys_suffix = self.get_prefix_and_suffix("system", [])
            history = [{"role": "system", "content": self.default_system_prompt}]
            prefix = sys_prefix + self.default_system_prompt + sys_suffix + self.get_prefix_and_suffix(role,
                                                                                                       history)[0]
        return prefix, suffix


chat_template_registry: dict[str, ChatTemplate] = {}
matching_function_registry: list[Callable[[str], str | None]] = []


def register_chat_template(template: ChatTemplate) -> None:
    chat_template_registry[template.name] = template


def register_chat_template_matching_function(func):
    matching_function_registry.append(func)
    return func


def get_chat_template(name: str) -> ChatTemplate:
    if name not in chat_template_registry:
        raise KeyError(f"chat template {name!r} is not registered; known: {sorted(chat_template_registry)}")
    return chat_template_registry[name]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    for match in matching_function_registry:
        name = match(str(model_path))
        if name is not None:
            return get_chat_template(name)
    return get_chat_template("default")


def _chatml(name: str, default_system_prompt: str | None) -> ChatTemplate:
    return ChatTemplate(name, default_system_prompt, {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n")}, stop_str=("<|im_end|>",))


for _template in [
    ChatTemplate("default", None, {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"),
                                   "assistant": ("ASSISTANT:", "\n")}),
    ChatTemplate("claude", None, {"system": ("", ""), "user": ("\n\nHuman: ", ""),
                                  "assistant": ("\n\nAssistant:", "")}),
    _chatml("chatml", None),
    _chatml("qwen", "You are a helpful assistant."),
    ChatTemplate("vicuna_v1.1", "A chat between a curious user and an artificial intelligence assistant. The "
                 "assistant gives helpful, detailed, and polite answers to the user's questions.",
                 {"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")}),
    ChatTemplate("llama-2-chat", None, {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"),
                                        "assistant": ("", " </s><s>")}, style=ChatTemplateStyle.LLAMA2),
    ChatTemplate("llama-3-instruct", None, {
        "system": ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
        "user": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
        "assistant": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")},
        stop_str=("<|eot_id|>",)),
    ChatTemplate("mistral", None, {"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"),
                                   "user": ("[INST] ", " [/INST]"), "assistant": ("", " </s><s>")},
                 stop_str=("</s>",)),
    ChatTemplate("gemma-it", None, {"system": ("", ""), "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                                    "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")}),
    ChatTemplate("deepseek-v3", None, {"system": ("", ""), "user": ("<\uff5cUser\uff5c>", ""),
                                       "assistant": ("<\uff5cAssistant\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>")},
                 stop_str=("<\uff5cend\u2581of\u2581sentence\uff5c>",)),
]:
    register_chat_template(_template)


_PATTERNS = [  # (regex over the model path, template name); first match wins
    (r"deepseek-(v3|r1)(?!.*base)", "deepseek-v3"),
    (r"vicuna|llava-v1\.5", "vicuna_v1.1"),
    (r"llama-2.*chat|codellama.*instruct", "llama-2-chat"),
    (r"(mistral|mixtral).*instruct", "mistral"),
    (r"llama-3.*instruct", "llama-3-instruct"),
    (r"tinyllama|smollm", "chatml"),
    (r"qwen.*(chat|instruct)", "qwen"),
    (r"gemma.*it", "gemma-it"),
]


@register_chat_template_matching_function
def _match_by_pattern(model_path: str) -> str | None:
    for pattern, name in _PATTERNS:
        if re.search(pattern, model_path, re.IGNORECASE):
            return name
    return None
