"""sglang.lang.chat_template: named role templates (used with chat_template_name=)."""
from deepinfer_lang.named_templates import (  # noqa: F401
    ChatTemplate,
    ChatTemplateStyle,
    chat_template_registry,
    get_chat_template,
    get_chat_template_by_model_path,
    matching_function_registry,
    register_chat_template,
    register_chat_template_matching_function,
)
