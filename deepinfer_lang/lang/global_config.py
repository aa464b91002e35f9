"""sglang.lang.global_config."""
from deepinfer_lang.config import GlobalConfig, global_config  # noqa: F401
