"""DeepSeek-V4.1: its config and per-layer descriptor (`config.py`). The oracle forward lives in
test/reference/deepseek_v41_ref.py."""
