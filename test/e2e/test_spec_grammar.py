"""Grammar-driven drafts end to end on SmolLM2: JSON-schema extraction decodes to the same tokens with
speculation on as off (greedy), with most tokens coming from accepted drafts."""
from __future__ import annotations

import json
from pathlib import Path

from deepinfer_rt import Engine, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "occupation": {"type": "string"}, "city": {"type": "string"}},
          "required": ["name", "age", "occupation", "city"]}


def test_json_extraction_identical_and_mostly_drafted(smollm2_engine, smollm2_path):
    data = (Path(__file__).parents[2] / "examples/data/people.jsonl").read_text().splitlines()
    tok = smollm2_engine.tokenizer
    prompts = [tok.apply_chat_template(
        [{"role": "system", "content": "Extract the person as JSON with the keys name, age, occupation and city."},
         {"role": "user", "content": json.loads(line)["text"]}], tokenize=False, add_generation_prompt=True)
        for line in data[:2]]
    params = SamplingParams(max_new_tokens=48, temperature=0, json_schema=json.dumps(SCHEMA))
    ref = smollm2_engine.generate(prompts, sampling_params=params)
    with Engine(str(smollm2_path), dtype="float32", kv_cache_tokens=4096, speculative="prompt_lookup") as e:
        outs = e.generate(prompts, sampling_params=params)
        stats = e.stats["spec"]
    assert [(o.token_ids, o.text) for o in outs] == [(r.token_ids, r.text) for r in ref]
    assert all(json.loads(o.text).keys() == SCHEMA["properties"].keys() for o in outs)
    # Keys, layout and copied names are drafted and accepted: over half the tokens come from drafts.
    assert stats["accepted"] >= 0.5 * sum(o.completion_tokens for o in outs), stats
