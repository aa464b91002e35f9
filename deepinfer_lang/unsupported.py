"""Names of SGLang's frontend whose feature cannot run here, and the error they raise.

Multimodal inputs (sgl.image, sgl.video) need a vision model; our models are text-only. The hosted-API
backends (OpenAI, Anthropic, VertexAI, LiteLLM, Crusoe) send programs to a provider over the network; this
frontend runs programs on a deepinfer_rt.Engine (Runtime / RuntimeBackend) or a `deepinfer serve` server
(RuntimeEndpoint). Each raises UnsupportedFeatureError naming the feature instead of failing on a missing name.
"""
from __future__ import annotations


class UnsupportedFeatureError(NotImplementedError):
    """A feature of SGLang's frontend that this runtime cannot provide (the message names it and says why)."""


def _backend_stub(name: str, what: str):
    def __init__(self, *args, **kwargs):
        raise UnsupportedFeatureError(
            f"sgl.{name}: the {what} backend is not available in deepinfer_lang (programs run on a local engine, "
            f"not a hosted API); use sgl.Runtime(model=...) or sgl.RuntimeEndpoint(url) of `deepinfer serve`")

    return type(name, (), {"__init__": __init__, "__doc__": f"Not available: {what} backend (raises on use)."})


OpenAI = _backend_stub("OpenAI", "OpenAI API")
Anthropic = _backend_stub("Anthropic", "Anthropic API")
VertexAI = _backend_stub("VertexAI", "Vertex AI")
LiteLLM = _backend_stub("LiteLLM", "LiteLLM")
Crusoe = _backend_stub("Crusoe", "Crusoe")


def multimodal_error(feature: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"sgl.{feature}: {feature} inputs need a vision model; deepinfer_lang serves "
                                   f"text-only models")
