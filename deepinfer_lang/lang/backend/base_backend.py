"""sglang.lang.backend.base_backend: BaseBackend is our RuntimeBackend (a backend over an engine)."""
from deepinfer_lang.backend import RuntimeBackend

BaseBackend = RuntimeBackend
