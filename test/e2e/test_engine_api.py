"""Engine API behaviour on a tiny random Llama (fast): sampling controls, n > 1, seeds, streaming, bad input."""
from __future__ import annotations

import asyncio

import pytest

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["hello world", "the sea is", "one two three four five six seven", "a"]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096) as e:
        yield e


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **kw)


def test_max_new_tokens_and_length_reason(engine):
    outs = engine.generate(PROMPTS, sampling_params=greedy(7, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [7] * 4
    assert all(o.finish_reason == "length" and o.completion_tokens == 7 for o in outs)
    assert [o.prompt_tokens for o in outs] == [len(engine.tokenizer.encode(p)) for p in PROMPTS]


def test_stop_token_ids_and_min_new_tokens(engine):
    base = engine.generate(PROMPTS[:1], sampling_params=greedy(12, ignore_eos=True))[0].token_ids
    stop_tok = base[4]
    first = base.index(stop_tok)
    out = engine.generate(PROMPTS[:1], sampling_params=greedy(12, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[: first + 1]
    # min_new_tokens forbids the stop token until it is reached: the output must differ from a stop at `first`.
    out = engine.generate(PROMPTS[:1], sampling_params=greedy(
        12, ignore_eos=True, stop_token_ids=[stop_tok], min_new_tokens=first + 2))[0]
    assert len(out.token_ids) >= first + 2
    assert stop_tok not in out.token_ids[: first + 1]


def test_stop_strings_cut_text(engine):
    base = engine.generate(PROMPTS[1:2], sampling_params=greedy(20, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 8
    stop = text[5:8]
    out = engine.generate(PROMPTS[1:2], sampling_params=greedy(20, ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_stream_reassembles_text(engine):
    sp = greedy(20, ignore_eos=True)
    full = engine.generate(PROMPTS[2:3], sampling_params=sp)[0].text
    deltas = list(engine.stream(PROMPTS[2], sp))
    assert "".join(deltas) == full and len(deltas) > 1
    stop = full[6:9]
    sp_stop = greedy(20, ignore_eos=True, stop=stop)
    assert "".join(engine.stream(PROMPTS[2], sp_stop)) == full[: full.index(stop)]


def test_async_generate_matches_generate(engine):
    sp = greedy(8, ignore_eos=True)
    sync = [o.token_ids for o in engine.generate(PROMPTS, sampling_params=sp)]

    async def main():
        parts = await asyncio.gather(*(engine.async_generate([p], sampling_params=sp) for p in PROMPTS))
        return [p[0].token_ids for p in parts]

    assert asyncio.run(main()) == sync


def test_n_samples_share_prompt_and_differ(engine):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=7, ignore_eos=True)
    outs = engine.generate(["a long shared prompt " * 5, "x"], sampling_params=sp)
    assert len(outs) == 8
    first = [tuple(o.token_ids) for o in outs[:4]]
    assert len(set(first)) > 1
    # Siblings reuse the leader's prompt KV: all but the last prompt token come from it.
    assert all(o.cached_tokens == o.prompt_tokens - 1 for o in outs[1:4])
    again = engine.generate(["a long shared prompt " * 5, "x"], sampling_params=sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert engine.pool.allocator.num_free + engine.cache.num_cached_pages == engine.pool.allocator.num_pages


def test_n_greedy_siblings_equal_single(engine):
    single = engine.generate(PROMPTS[:1], sampling_params=greedy(9, ignore_eos=True))[0].token_ids
    outs = engine.generate(PROMPTS[:1], sampling_params=greedy(9, ignore_eos=True, n=3))
    assert [o.token_ids for o in outs] == [single] * 3


def test_seeded_sampling_reproducible_across_batches(engine):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate(PROMPTS[:1], sampling_params=sp)[0].token_ids
    other = SamplingParams(max_new_tokens=5, temperature=0.7, seed=99, ignore_eos=True)
    batch = engine.generate(PROMPTS * 3, sampling_params=[sp, other, other, other] * 3)
    assert [batch[i].token_ids for i in (0, 4, 8)] == [alone] * 3
    mixed = engine.generate([PROMPTS[3], PROMPTS[0], PROMPTS[1]], sampling_params=[other, sp, other])
    assert mixed[1].token_ids == alone
    different = engine.generate(PROMPTS[:1], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1235, ignore_eos=True))[0].token_ids
    assert different != alone


def test_logprobs_are_consistent(engine):
    out = engine.generate(PROMPTS[:1], sampling_params=greedy(5, ignore_eos=True, logprobs=True,
                                                              top_logprobs=3))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 5
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy picks the top token
        assert top[0][1] >= top[1][1] >= top[2][1]
        assert lp <= 0.0


@pytest.mark.parametrize("params, field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(presence_penalty=-3.0), "presence_penalty"), (dict(n=0), "n"),
    (dict(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"), (dict(top_logprobs=100), "top_logprobs"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"), (dict(stop=[""]), "stop"),
    (dict(regex="a+", ebnf='root ::= "a"'), "regex/json_schema/ebnf"),
])
def test_bad_sampling_params_name_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field.replace("/", ".")):
        engine.generate(["hi"], sampling_params=SamplingParams(**params))


def test_bad_inputs_are_rejected_and_engine_keeps_serving(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="prompts"):
        engine.generate([""])
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[[]])
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[[1, vocab]])
    with pytest.raises(ValueError, match="context"):
        engine.generate(input_ids=[[1] * engine.model_config.max_position])
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(ValueError, match="sampling_params"):
        engine.generate(["a", "b"], sampling_params=[greedy(2)])
    assert not engine.scheduler.has_work  # nothing half-submitted
    outs = engine.generate(["still serving"], sampling_params=greedy(3, ignore_eos=True))
    assert outs[0].finish_reason == "length"


def test_penalties_change_outputs(engine):
    base = engine.generate(PROMPTS[:1], sampling_params=greedy(16, ignore_eos=True))[0].token_ids
    assert len(set(base)) < len(base)  # a tiny random model repeats itself
    rep = engine.generate(PROMPTS[:1], sampling_params=greedy(16, ignore_eos=True, repetition_penalty=100.0,
                                                              ))[0].token_ids
    assert len(set(rep)) == len(rep)  # every seen token is pushed down hard
    freq = engine.generate(PROMPTS[:1], sampling_params=greedy(16, ignore_eos=True, presence_penalty=2.0,
                                                               frequency_penalty=2.0))[0].token_ids
    assert freq != base


def test_context_manager_shutdown(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=256) as e:
        e.generate(["x"], sampling_params=greedy(2))
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(["x"])


def test_requests_larger_than_the_pool_fail_alone(tiny_llama_path):
    """A prompt that cannot fit even an empty pool errors; the other request of the batch still finishes."""
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=8, chunked_prefill_tokens=16) as e:
        big, small = e.generate(input_ids=[[5] * 12, [6] * 3], sampling_params=greedy(3, ignore_eos=True))
        assert big.finish_reason == "error" and "KV pool" in big.error
        assert small.finish_reason == "length" and len(small.token_ids) == 3
        # Growing past the whole pool while decoding ends the request at the pool's size.
        (out,) = e.generate(input_ids=[[6] * 3], sampling_params=greedy(20, ignore_eos=True))
        assert out.finish_reason == "length" and out.prompt_tokens + out.completion_tokens <= 9
        assert e.pool.allocator.num_free + e.cache.num_cached_pages == e.pool.allocator.num_pages


def test_prompt_logprobs_from_a_start_position(engine):
    ids = engine.tokenizer.encode("one two three four five six seven eight nine ten")
    full = engine.generate(input_ids=[ids], sampling_params=greedy(1, prompt_logprobs=True))[0].prompt_logprobs
    assert len(full) == len(ids) and full[0] is None and all(v is not None for v in full[1:])
    part = engine.generate(input_ids=[ids], sampling_params=greedy(1, prompt_logprobs=True,
                                                                   logprob_start_len=6))[0].prompt_logprobs
    assert part[:6] == [None] * 6
    assert max(abs(a - b) for a, b in zip(part[6:], full[6:])) < 1e-5
