"""sglang.lang.backend.openai: not available here (raises UnsupportedFeatureError naming it)."""
from deepinfer_lang.unsupported import OpenAI  # noqa: F401
