"""SGLang's frontend benchmark programs (few-shot GSM8K, MMLU-style select, JSON decoding, tree of thought, ReAct,
multi-turn chat, parallel sampling) ported to deepinfer_lang on small datasets shipped in data/. See harness.py;
run one with `python -m benchmark.sglang_programs.<name>` or all with `python -m benchmark.sglang_programs`."""

PROGRAMS = ["gsm8k", "mmlu", "json_decode", "tree_of_thought", "react", "multi_turn_chat", "parallel_sampling"]
