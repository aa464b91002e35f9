"""deepinfer_lang programs against a running server (RuntimeEndpoint) give what the in-process backend gives;
the native /generate takes token ids with our full SamplingParams."""
from __future__ import annotations

import httpx
import pytest

import deepinfer_lang as sgl
from deepinfer_rt import SamplingParams


@sgl.function
def _pick(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=10, temperature=0))
    s += sgl.user("Is that a color or an animal?")
    s += sgl.assistant(sgl.select("kind", choices=["a color", "an animal"]))


def test_program_on_endpoint_equals_in_process(server_url, smollm2_engine):
    question = "Name one animal."
    local = _pick.run(question=question, backend=sgl.RuntimeBackend(smollm2_engine))
    endpoint = sgl.RuntimeEndpoint(server_url)
    try:
        remote = _pick.run(question=question, backend=endpoint)
        assert remote["answer"] == local["answer"]
        assert remote["kind"] == local["kind"]
        assert remote.text() == local.text()
        assert remote.get_meta_info("kind")["scores"] == pytest.approx(local.get_meta_info("kind")["scores"],
                                                                        abs=1e-4)
        streamed = "".join(endpoint.stream(smollm2_engine.tokenizer.encode("Once upon a time"),
                                           SamplingParams(max_new_tokens=8, temperature=0)))
        ref = smollm2_engine.generate(["Once upon a time"], sampling_params=SamplingParams(max_new_tokens=8,
                                                                                          temperature=0))[0]
        assert streamed == ref.text
    finally:
        endpoint.shutdown()


def test_native_generate_batch_with_per_input_params(server_url, smollm2_engine):
    ids = smollm2_engine.tokenizer.encode("The sun rises in the")
    params = [{"max_new_tokens": 5, "temperature": 0, "logprobs": True},
              {"max_new_tokens": 3, "temperature": 0.8, "n": 2, "seed": 3, "stop_token_ids": [2]}]
    outs = httpx.post(f"{server_url}/generate", json={"input_ids": [ids, ids], "sampling_params": params},
                      timeout=60).json()
    assert len(outs) == 3  # n outputs per input, grouped, in input order
    ref = smollm2_engine.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=5, temperature=0,
                                                                                 logprobs=True))[0]
    assert outs[0]["output_ids"] == ref.token_ids and outs[0]["text"] == ref.text
    assert outs[0]["meta_info"]["logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    assert [o["meta_info"]["completion_tokens"] for o in outs[1:]] == [len(o["output_ids"]) for o in outs[1:]]
    assert all(o["meta_info"]["finish_reason"] in ("stop", "length") for o in outs)
