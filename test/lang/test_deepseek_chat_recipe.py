"""Chat roles for DeepSeek-V4 models, rendered by deepseek-recipe: a program of appended roles ends with exactly
the recipe's rendering of its messages, and the generation prompt the recipe adds comes last."""
from __future__ import annotations

import deepseek_recipe
import pytest

from deepinfer_lang.chat_template import ChatTemplate

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def _recipe_render(encoding, messages: list[dict]) -> str:
    kinds = {"system": deepseek_recipe.SystemMessage, "user": deepseek_recipe.UserMessage,
             "assistant": deepseek_recipe.AssistantMessage}
    conversation = deepseek_recipe.Conversation([kinds[m["role"]](m["content"]) for m in messages],
                                                thinking_mode=False)
    return encoding.render_conversation(conversation).prompt


@pytest.mark.parametrize("recipe, encoding", [("deepseek_v4", deepseek_recipe.DeepseekV4Encoding),
                                              ("deepseek_v41", deepseek_recipe.DeepseekV41Encoding)])
def test_appended_roles_reproduce_the_recipe(recipe, encoding):
    template = ChatTemplate(tokenizer=None, recipe=recipe)
    text = ""
    for i, message in enumerate(CONVERSATION):
        begin, end = template.role_segments(CONVERSATION[:i], message["role"])
        text += begin + message["content"] + end
    assistant_begin, _ = template.role_segments(CONVERSATION, "assistant")
    assert text.startswith("<｜begin▁of▁sentence｜>")
    assert text + assistant_begin == _recipe_render(encoding(), CONVERSATION)


def test_unknown_recipe_and_role_are_refused():
    with pytest.raises(ValueError, match="recipe must be one of"):
        ChatTemplate(tokenizer=None, recipe="deepseek_v9")
    with pytest.raises(ValueError, match="roles must be in"):
        ChatTemplate(tokenizer=None, recipe="deepseek_v4").role_segments([], "tool")
