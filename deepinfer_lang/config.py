"""Process-wide settings of the frontend (SGLang's global_config: sgl.global_config, sglang.lang.global_config)."""
from __future__ import annotations


class GlobalConfig:
    def __init__(self):
        self.verbosity = 0
        """2: print each program's final text when it finishes."""
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True
        """run_batch computes the programs' shared prompt prefix once before they start."""
        self.enable_parallel_encoding = True

    @property
    def default_backend(self):
        """The backend of programs run without backend= (set_default_backend); kept in deepinfer_lang.backend."""
        import deepinfer_lang.backend

        return deepinfer_lang.backend._default_backend

    @default_backend.setter
    def default_backend(self, value) -> None:
        import deepinfer_lang.backend

        deepinfer_lang.backend.set_default_backend(value)


global_config = GlobalConfig()

__all__ = ["GlobalConfig", "global_config"]
