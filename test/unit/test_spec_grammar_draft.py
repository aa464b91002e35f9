"""Grammar-driven drafts: the JSON scanner, value copying, and the drafter on a real schema with the SmolLM2
tokenizer, replaying a model-style JSON answer (json.dumps(indent=2), what SmolLM2 prints) step by step."""
from __future__ import annotations

import json

import pytest

from deepinfer_rt.constrained.grammar import GrammarBackend
from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.drafter import PromptLookupDrafter
from deepinfer_rt.speculative.grammar_draft import GrammarDrafter, copy_from_prompt, scan_json

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "occupation": {"type": "string"}, "city": {"type": "string"}},
          "required": ["name", "age", "occupation", "city"]}
PROMPT = "Extract the person as JSON.\nRecord 7: Maria Lopez, 34, is a nurse in Madrid."
ANSWER = {"name": "Maria Lopez", "age": 34, "occupation": "Nurse", "city": "Madrid"}


@pytest.mark.parametrize("text, expected", [
    ('{\n  "name": "Mar', (True, "Mar", 1, ":")),
    ('{\n  "na', (True, "na", 1, "{")),
    ('{"a": "x\\"y", "b": [1, ', (False, "", 2, ",")),
    ('{"a": {"b": "}"}}', (False, "", 0, "}")),
    ('{"a": 3', (False, "", 1, "3")),
])
def test_scan_json(text, expected):
    assert scan_json(text) == expected


def test_copy_from_prompt():
    assert copy_from_prompt(PROMPT, "Mar") == "ia Lopez"  # up to the comma
    assert copy_from_prompt(PROMPT, "N") == "urse in Madrid"  # case-insensitive, at a word start only
    assert copy_from_prompt(PROMPT, "Mad") == "rid"
    assert copy_from_prompt(PROMPT, "adr") == ""  # inside a word: no match
    assert copy_from_prompt(PROMPT, "") == ""


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from deepinfer_rt.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


def replay(tokenizer, answer_ids: list[int], k: int = 5) -> tuple[int, int, list[int]]:
    """Decode answer_ids as a target that always emits them would, drafting with GrammarDrafter each step.
    Returns (steps, accepted drafts, numbers of tokens proposed per step)."""
    eos = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    backend = GrammarBackend(tokenizer, len(tokenizer), eos, compile_timeout_s=60)
    handle = backend.submit("json", json.dumps(SCHEMA))
    backend.wait([handle])
    status, grammar = backend.poll(handle)
    assert status == "ready"
    req = Req(0, tokenizer.encode(PROMPT), SamplingParams(temperature=0, json_schema=json.dumps(SCHEMA)), 0)
    req.grammar = grammar
    drafter = GrammarDrafter(tokenizer, PromptLookupDrafter(1, 3))
    steps = accepted = 0
    proposed = []
    while req.num_output_tokens < len(answer_ids):
        proposal = drafter.propose(req, k)
        drafts = proposal.tokens if proposal else []
        assert len(drafts) <= k and (not proposal or len(proposal.confidences) == len(drafts))
        fork = grammar.fork()
        assert all(fork.accept(t) for t in drafts)  # drafts never break the grammar
        expected = answer_ids[req.num_output_tokens :]
        n = next((i for i, (d, e) in enumerate(zip(drafts, expected)) if d != e), min(len(drafts), len(expected)))
        for token in expected[: n + 1]:
            assert grammar.accept(token)
            req.token_ids.append(token)
        steps, accepted = steps + 1, accepted + n
        proposed.append(len(drafts))
    return steps, accepted, proposed


def test_drafts_follow_the_schema_layout_and_copy_values(tokenizer):
    answer = tokenizer.encode(json.dumps(ANSWER, indent=2))
    steps, accepted, proposed = replay(tokenizer, answer)
    # Keys, quotes, colons, commas, layout and the copied name and city: only "N" of "Nurse" and the first
    # characters of values are the model's own. Plain decoding takes len(answer) (35) steps.
    assert steps <= 9 and accepted >= len(answer) - 9, (steps, accepted, proposed)


def test_other_layouts_only_cost_acceptance(tokenizer):
    """Compact JSON (no layout whitespace): drafts mispredict the layout but stay grammar-valid, and forced
    keys are still drafted."""
    answer = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")))
    steps, accepted, _ = replay(tokenizer, answer)
    assert accepted > 0 and steps < len(answer)
