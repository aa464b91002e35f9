"""sglang.lang.backend.vertexai: not available here (raises UnsupportedFeatureError naming it)."""
from deepinfer_lang.unsupported import VertexAI  # noqa: F401
