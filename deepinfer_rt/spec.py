"""The published import path of the speculative-decoding config; the package is `deepinfer_rt.speculative`."""
from deepinfer_rt.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
