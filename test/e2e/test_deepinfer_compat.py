"""DeepInfer 0.1.0's offline API over our engine: a DeepInfer script runs with only its import changed; teacher
forcing (golden_token_ids), top_logprobs beyond 20, prompt logprobs, refusals of what does not map."""
from __future__ import annotations

import math
import runpy

import pytest

from deepinfer_rt import LLM as TopLevelLLM
from deepinfer_rt import SamplingParams as EngineParams
from deepinfer_rt.compat.deepinfer import LLM, RequestOutput, SamplingParams

DEEPINFER_SCRIPT = '''
import json
import os

from deepinfer import LLM, SamplingParams

llm = LLM(os.environ["DEEPINFER_TEST_MODEL"], expert_parallel_size=1, seed=0, trust_remote_code=True,
          gpu_memory_utilization=0.5, disable_log_stats=True, max_num_seqs=8)
prompts = ["The color of the sky is", "One, two, three,"]
texts = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, seq_seed=1), use_tqdm=False)
schema = {"type": "string", "enum": ["red", "green", "blue"]}
params = SamplingParams(max_tokens=16, temperature=0.7, so_args={"schema_type": "json", "schema": json.dumps(schema)},
                        seq_seed=7)
llm.decode_sequence = False
outputs = llm.generate(prompts, params)
tokenizer = llm.get_tokenizer()
colors = [json.loads(tokenizer.decode([o.token_id for o in out], skip_special_tokens=True)) for out in outputs]
logprobs = [[o.token_logprobs for o in out] for out in outputs]
finished = [out[-1].finished and out[-1].finish_reason for out in outputs]
llm.close()
'''


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    with LLM(str(tiny_llama_path), decode_sequence=False, kv_cache_tokens=4096) as llm:
        yield llm


def test_deepinfer_script_runs_with_only_its_import_changed(tiny_llama_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_TEST_MODEL", str(tiny_llama_path))
    script = DEEPINFER_SCRIPT.replace("from deepinfer import", "from deepinfer_rt.compat.deepinfer import")
    assert script.count("deepinfer_rt") == 1
    g = runpy.run_path(_write(script, tiny_llama_path.parent / "deepinfer_script.py"))
    assert len(g["texts"]) == 2 and all(isinstance(t, str) and t for t in g["texts"])
    assert all(c in ("red", "green", "blue") for c in g["colors"])
    assert all(lp and all(v <= 0.0 for v in lp) for lp in g["logprobs"])
    assert g["finished"] == ["stop", "stop"]


def _write(text, path):
    path.write_text(text)
    return str(path)


def test_top_level_name():
    assert TopLevelLLM is LLM


def test_golden_tokens_are_teacher_forced(llm):
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    prompt = tok.encode("a b c d")
    golden = tok.encode(" e f g", add_special_tokens=False)
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=len(golden) + 3, temperature=0, golden_token_ids=golden, ignore_eos=True), use_tqdm=False)
    assert [o.token_id for o in out[: len(golden)]] == golden
    assert len(out) == len(golden) + 3 and out[-1].finished and out[-1].finish_reason == "length"
    assert [o.num_output_tokens for o in out] == list(range(1, len(out) + 1))
    # Reference: the forced tokens as part of the prompt, scored and continued by the engine directly.
    (ref,) = engine.generate(input_ids=[prompt + golden], sampling_params=EngineParams(
        max_new_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=True, logprobs=True))
    assert [o.token_id for o in out[len(golden):]] == ref.token_ids
    expected = ref.prompt_logprobs[len(prompt):] + ref.logprobs
    assert [o.token_logprobs for o in out] == pytest.approx(expected, abs=1e-5)


def test_golden_tokens_within_max_tokens_and_eos(llm):
    tok = llm.get_tokenizer()
    prompt = tok.encode("x y")
    golden = tok.encode(" one two three four", add_special_tokens=False)
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=2, golden_token_ids=golden), use_tqdm=False)
    assert [o.token_id for o in out] == golden[:2] and out[-1].finish_reason == "length"
    eos = llm.llm_engine.eos_ids[0]
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=8, golden_token_ids=[golden[0], eos, golden[1]]), use_tqdm=False)
    assert [o.token_id for o in out] == [golden[0], eos] and out[-1].finish_reason == "stop"
    with pytest.raises(ValueError, match="golden_token_ids"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(golden_token_ids=[-1]))
    with pytest.raises(ValueError, match="golden_token_ids with top_logprobs"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(golden_token_ids=golden,
                                                                              top_logprobs=3))


def test_top_logprobs_beyond_twenty_and_prompt_logprobs(llm):
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    prompt = tok.encode("hello world, this is")
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=3, temperature=0, top_logprobs=50, prompt_logprobs=True, ignore_eos=True), use_tqdm=False)
    assert len(out) == 3 and out[0].prompt_len == len(prompt)
    for o in out:
        assert len(o.top_logprobs) == len(o.top_token_ids) == 50
        assert o.top_logprobs == sorted(o.top_logprobs, reverse=True)
        assert o.top_token_ids[0] == o.token_id and o.top_logprobs[0] == pytest.approx(o.token_logprobs)
    (ref,) = engine.generate(input_ids=[prompt], sampling_params=EngineParams(max_new_tokens=1, temperature=0,
                                                                              prompt_logprobs=True))
    assert out[0].prompt_logprobs == pytest.approx(ref.prompt_logprobs[1:], abs=1e-5)
    assert out[1].prompt_logprobs == [] and len(out[0].prompt_logprobs) == len(prompt) - 1
    with pytest.raises(NotImplementedError, match="sum_smaller_probs"):
        out[0].sum_smaller_probs  # noqa: B018


def test_chat_and_decoded_text(llm):
    llm.decode_sequence = True
    try:
        texts = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        ids = llm.generate(prompt_token_ids=[tok.encode(text, add_special_tokens=False)],
                           sampling_params=SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    finally:
        llm.decode_sequence = False
    assert len(texts) == 1 and texts == ids


def test_sampling_params_checks_and_mapping():
    for bad in (dict(top_logprobs=1001), dict(top_k=0), dict(top_p=0.0), dict(temperature=-1.0),
                dict(so_args={"schema": "{}"}), dict(so_args={"schema_type": "yaml", "schema": ""}),
                dict(so_args={"schema_type": "json", "schema": "{}", "trigger_token_ids": [1]})):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(max_tokens=0).max_tokens == 1
    p = SamplingParams(temperature=1e-6, first_n_token_no_eos=1, seq_seed=-1, max_tokens=5, top_logprobs=100,
                       so_args={"schema_type": "regex", "schema": "[ab]+"})
    ours = p.to_engine((2,), num_forced=0, logprobs=True)
    assert ours.temperature == 0.0 and ours.min_new_tokens == 1 and ours.seed == 2**64 - 1
    assert ours.max_new_tokens == 5 and ours.regex == "[ab]+" and ours.top_logprobs == 100
    ours.validate(1000)
    with pytest.raises(ValueError, match="eos_id"):
        SamplingParams(eos_id=7).to_engine((2,), 0, False)


@pytest.mark.parametrize("kwargs, error", [
    (dict(max_model_len=1024), ValueError), (dict(revision="main"), ValueError),
    (dict(tokenizer="/elsewhere"), ValueError), (dict(stop_preempted_request=True), ValueError),
    (dict(data_parallel_size=4), ValueError), (dict(no_such_argument=1), TypeError),
    (dict(offline_inference=True), TypeError)])
def test_constructor_refuses_what_does_not_map(tiny_llama_path, kwargs, error):
    with pytest.raises(error):
        LLM(str(tiny_llama_path), **kwargs)


def test_request_output_shape():
    o = RequestOutput("0", 3, 5, "stop", True, -0.5)
    assert (o.request_id, o.prompt_len, o.token_id, o.finish_reason, o.finished, o.token_logprobs) == \
        ("0", 3, 5, "stop", True, -0.5)
    assert not math.isnan(o.token_logprobs) and o.prompt_logprobs == []
