"""sglang.lang.backend.anthropic: not available here (raises UnsupportedFeatureError naming it)."""
from deepinfer_lang.unsupported import Anthropic  # noqa: F401
