"""What the engine guarantees for every model holds for DeepSeek-V4.1 too (tiny config 'a', fp32): n > 1 siblings
(greedy siblings equal the single request, seeded sampling reproducible), structured output (a regex and a JSON
schema constrain the text), and the expert-parallel worker pool (EP=2 greedy tokens equal EP=1)."""
from __future__ import annotations

import json
import re

import pytest

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 900, 1200, 77, 3000, 41, 15000], [19000, 8, 8, 8, 250, 6021, 14, 7, 999, 12345, 2, 3]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_v41_paths):
    with Engine(str(tiny_v41_paths["a"]), dtype="float32", kv_cache_tokens=2048) as e:
        yield e


def test_n_greedy_siblings_equal_single_and_sampled_siblings_reproducible(engine):
    single = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    n3 = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=6, temperature=0, n=3,
                                                                           ignore_eos=True))
    assert [o.token_ids for o in n3] == [single[0]] * 3 + [single[1]] * 3
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    first = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=sampled)]
    again = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=sampled)]
    assert first == again and len(set(map(tuple, first[:3]))) > 1


def test_structured_output(engine):
    pattern = r"[a-z]{3,8} [0-9]{1,3}"
    out = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=16, temperature=0,
                                                                                regex=pattern))[0]
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = engine.generate(input_ids=PROMPTS[1:], sampling_params=SamplingParams(
        max_new_tokens=24, temperature=1.0, seed=3, json_schema=json.dumps(schema)))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["n"], int), out.text


def test_expert_parallel_pool_equals_in_process(tiny_v41_paths, engine):
    want = [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with Engine(str(tiny_v41_paths["a"]), dtype="float32", kv_cache_tokens=2048, ep_size=2) as ep2:
        got = [o.token_ids for o in ep2.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want
