"""separate_reasoning: split a gen's text into its reasoning (between the model family's think markers) and the
answer after it. model_type names the family as SGLang's reasoning parsers do."""
from __future__ import annotations

# model_type -> (start marker, end marker, whether the text is reasoning from its first token: some templates
# open the think block in the prompt, so the model's text starts inside it and only the end marker appears)
_MARKERS = {
    "deepseek-r1": ("<think>", "</think>", True),
    "deepseek-v3": ("<think>", "</think>", False),
    "qwen3": ("<think>", "</think>", False),
    "qwen3-thinking": ("<think>", "</think>", True),
    "glm45": ("<think>", "</think>", False),
    "step3": ("<think>", "</think>", True),
    "minimax": ("<think>", "</think>", True),
    "kimi": ("\u25c1think\u25b7", "\u25c1/think\u25b7", False),
}


def split_reasoning(model_type: str | None, text: str) -> tuple[str, str]:
    """(reasoning, answer) of `text`."""
    if model_type not in _MARKERS:
        raise ValueError(f"separate_reasoning: model_type must be one of {sorted(_MARKERS)}, got {model_type!r}")
    start, end, starts_inside = _MARKERS[model_type]
    body = text.lstrip()
    if body.startswith(start):
        body, starts_inside = body[len(start):], True
    if not starts_inside:
        return "", text
    if end not in body:  # still thinking when the gen stopped: all of it is reasoning
        return body.strip(), ""
    reasoning, answer = body.split(end, 1)
    return reasoning.strip(), answer.lstrip()
