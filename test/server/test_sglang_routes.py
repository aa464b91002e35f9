"""SGLang's native protocol on the real server (the SmolLM2 server of conftest.py): /sglang/get_model_info and an
SGLang-format /sglang/generate whose text equals the in-process engine's greedy output; our own /generate keeps
its format at the root."""
from __future__ import annotations

import httpx

from deepinfer_rt import SamplingParams


def test_sglang_generate_through_the_server(server_url, smollm2_engine):
    info = httpx.get(f"{server_url}/sglang/get_model_info", timeout=30).json()
    assert "model_path" in info
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    out = httpx.post(f"{server_url}/sglang/generate", json=body, timeout=120).json()
    ref = smollm2_engine.generate(["The capital of France is"],
                                  sampling_params=SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert out["text"] == ref.text
    assert out["meta_info"]["completion_tokens"] == len(ref.token_ids)
    assert "finish_reason" in out["meta_info"]
