"""sglang.lang.global_config."""
from deepinfer_lang.global_config import GlobalConfig, global_config  # noqa: F401
