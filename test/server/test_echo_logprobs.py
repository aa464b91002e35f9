"""/v1/completions with echo and logprobs, as evaluation harnesses score continuations: the prompt's tokens come
back first with their logprobs (the first one null) and top alternatives; max_tokens 0 scores the prompt alone.
Prompt logprobs are checked against transformers."""
from __future__ import annotations

import httpx
import pytest
import torch
from conftest import MODEL_NAME

CONTEXT = "Question: What color is the sky on a clear day?\nAnswer:"
CONTINUATIONS = [" blue", " green", " the color of grass"]


@pytest.fixture(scope="module")
def scored(smollm2_engine, smollm2_hf):
    """Token ids of context + each continuation, and transformers' log-softmax over each."""
    tok = smollm2_engine.tokenizer
    ctx = tok.encode(CONTEXT)
    rows = []
    for cont in CONTINUATIONS:
        ids = ctx + tok.encode(cont, add_special_tokens=False)
        with torch.no_grad():
            lp = smollm2_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        rows.append((ids, lp))
    return len(ctx), rows


@pytest.fixture(scope="module")
def tok(smollm2_engine):
    return smollm2_engine.tokenizer


def test_echo_logprobs_match_transformers(client, scored, tok):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0."""
    ctxlen, rows = scored
    out = client.completions.create(model=MODEL_NAME, prompt=[ids for ids, _ in rows], echo=True, logprobs=1,
                                    max_tokens=1, temperature=0, seed=1234)
    assert len(out.choices) == len(rows)
    for choice, (ids, ref) in zip(sorted(out.choices, key=lambda c: c.index), rows):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
        assert lp.token_logprobs[1:-1] == pytest.approx(expected, abs=1e-4)
        for j, top in enumerate(lp.top_logprobs[1:-1]):  # the most likely token at each prompt position
            (token, value), = top.items()
            best = ref[j].argmax().item()
            assert value == pytest.approx(ref[j, best].item(), abs=1e-4)
            assert token == tok.decode([best])
        # the generated token follows: greedy, so it is its position's top token
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
        # lm-eval's parse: sum over the continuation and is_greedy
        cont = lp.token_logprobs[ctxlen:-1]
        is_greedy = all(t == max(top.values()) for t, top in zip(cont, lp.top_logprobs[ctxlen:-1]))
        ref_greedy = all(ref[j - 1].argmax().item() == ids[j] for j in range(ctxlen, len(ids)))
        assert is_greedy == ref_greedy
        assert sum(cont) == pytest.approx(sum(expected[ctxlen - 1:]), abs=1e-3)
        assert choice.text.startswith(tok.decode(ids))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # " blue" is the model's greedy answer, " the color of grass" is not
    greedy = [all(t == max(top.values()) for t, top in zip(c.logprobs.token_logprobs[ctxlen:-1],
                                                          c.logprobs.top_logprobs[ctxlen:-1])) for c in out.choices]
    assert greedy[2] is False


def test_echo_max_tokens_zero_scores_the_prompt_only(client, scored, tok):
    _, rows = scored
    ids, ref = rows[0]
    out = client.completions.create(model=MODEL_NAME, prompt=ids, echo=True, logprobs=3, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == tok.decode(ids)
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([ref[j, ids[j + 1]].item()
                                                                for j in range(len(ids) - 1)], abs=1e-4)
    for j, top in enumerate(choice.logprobs.top_logprobs[1:]):  # top 3 of the position, as transformers ranks
        vals, best = ref[j].topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(vals.tolist(), abs=1e-4)
        assert set(top) == {tok.decode([t]) for t in best.tolist()}
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length"


def test_echo_text_prompt_without_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=CONTEXT, echo=True, max_tokens=3, temperature=0)
    plain = client.completions.create(model=MODEL_NAME, prompt=CONTEXT, max_tokens=3, temperature=0)
    assert out.choices[0].text == CONTEXT + plain.choices[0].text
    assert out.choices[0].logprobs is None
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=CONTEXT, echo=True, max_tokens=3, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "logprobs": 1, "stream": True}, "logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
])
def test_echo_refusals_name_the_field(server_url, body, param):
    r = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_native_generate_prompt_top_logprobs(server_url, scored):
    """SamplingParams.prompt_logprobs as a count over /generate: the top tokens at each prompt position."""
    _, rows = scored
    ids, ref = rows[1]
    r = httpx.post(f"{server_url}/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0, "prompt_logprobs": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()[0]["meta_info"]
    tops = meta["prompt_top_logprobs"]
    assert len(tops) == len(meta["prompt_logprobs"]) == len(ids) and tops[0] is None
    for j, top in enumerate(tops[1:]):
        vals, best = ref[j].topk(2)
        assert [t for t, _ in top] == best.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
