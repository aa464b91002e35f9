"""sglang.lang.backend.crusoe: not available here (raises UnsupportedFeatureError naming it)."""
from deepinfer_lang.unsupported import Crusoe  # noqa: F401
