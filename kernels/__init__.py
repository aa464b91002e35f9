"""deepinfer_kernels: compute kernels. `reference` holds the torch reference ops every fast kernel is
checked against; device kernels (Triton) live beside it and are chosen by the layers in deepinfer_rt."""
from deepinfer_kernels import reference

__all__ = ["reference"]
