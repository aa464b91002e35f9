"""DeepSeek-V4.1: config and per-layer descriptor (config.py), attention over the KV pool (attention.py), Engram
(engram.py), the model (model.py). Its oracle is test/reference/deepseek_v41_ref.py."""
