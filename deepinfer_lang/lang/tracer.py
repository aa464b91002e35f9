"""sglang.lang.tracer: not provided (programs run eagerly; run_batch's prefix probe replaces tracing)."""
from deepinfer_lang.unsupported import UnsupportedFeatureError


def trace_program(*args, **kwargs):
    raise UnsupportedFeatureError("sglang.lang.tracer.trace_program: SGLang's tracer is not provided")


def extract_prefix_by_tracing(*args, **kwargs):
    raise UnsupportedFeatureError("sglang.lang.tracer.extract_prefix_by_tracing: use Program.cache(backend)")
