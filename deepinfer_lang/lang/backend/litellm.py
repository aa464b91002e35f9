"""sglang.lang.backend.litellm: not available here (raises UnsupportedFeatureError naming it)."""
from deepinfer_lang.unsupported import LiteLLM  # noqa: F401
