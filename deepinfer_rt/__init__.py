"""deepinfer_rt: the in-process runtime (continuous batching, prefix cache, structured output)."""
from deepinfer_rt.engine import Engine
from deepinfer_rt.request import GenerateOutput
from deepinfer_rt.sampling_params import SamplingParams

__all__ = ["Engine", "GenerateOutput", "SamplingParams"]
