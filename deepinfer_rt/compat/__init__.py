"""Drop-in offline APIs of other engines over deepinfer_rt.Engine (`compat.deepinfer`: DeepInfer 0.1.0's)."""
