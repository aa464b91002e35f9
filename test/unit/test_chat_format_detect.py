"""The chat format follows the checkpoint: a DeepSeek-V4 or V4.1 folder without a Jinja template is rendered by
its own deepseek-recipe encoding (V4.1 is not V4's), with DSML tool calls; chat_encoding overrides the choice."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("deepseek_recipe")

from deepinfer_rt.server.chat import RecipeChatRenderer, make_chat_format  # noqa: E402


@pytest.mark.parametrize("model_type, encoding", [("deepseek_v4", "DeepseekV4Encoding"),
                                                  ("deepseek_v41", "DeepseekV41Encoding")])
def test_recipe_encoding_by_model_type(tmp_path, model_type, encoding):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    fmt = make_chat_format(SimpleNamespace(chat_template=None), tmp_path)
    assert isinstance(fmt.renderer, RecipeChatRenderer)
    assert type(fmt.renderer.encoding).__name__ == encoding
    assert fmt.tool_format == "dsml" and fmt.is_reasoning_model
    forced = make_chat_format(SimpleNamespace(chat_template=None), tmp_path, chat_encoding="deepseek_v4")
    assert type(forced.renderer.encoding).__name__ == "DeepseekV4Encoding"


def test_lang_backend_maps_v41_to_its_recipe():
    from deepinfer_lang.backend import _CHAT_RECIPES
    from deepinfer_lang.chat_template import ChatTemplate

    template = ChatTemplate(tokenizer=None, recipe=_CHAT_RECIPES["DeepseekV41ForCausalLM"])
    assert type(template.recipe.encoding).__name__ == "DeepseekV41Encoding"
