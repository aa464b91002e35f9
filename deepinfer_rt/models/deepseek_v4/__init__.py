"""DeepSeek-V4: everything only this model uses (attention kinds, compressor and indexer, mHC hyper-connections,
hash-routed MoE, its batch metadata and its batch-invariant forms). The model class is in `model.py`."""
