"""Engine.add_request / abort, the hooks the server's scheduler process drives: an aborted request gives its KV
back at once, whether it was waiting, prefilling or decoding, and the others finish unaffected."""
from __future__ import annotations

import pytest

from deepinfer_rt import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096, chunked_prefill_tokens=16) as e:
        yield e


def _pages_held_by_requests(engine) -> int:
    stats = engine.stats
    return stats["num_pages"] - stats["num_free_pages"] - stats["num_cached_pages"]


@pytest.mark.parametrize("num_steps", [0, 1, 4])  # waiting / mid-prefill (chunked) / decoding
def test_abort_frees_kv_and_spares_the_others(engine, num_steps):
    engine.flush_cache()
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with engine.hold_loop():  # steps driven here: the abort lands while waiting / prefilling / decoding
        keep = engine.add_request(list(range(3, 23)), params)
        victims = engine.add_request(list(range(40, 80)), SamplingParams(max_new_tokens=50, n=2, ignore_eos=True))
        for _ in range(num_steps):
            engine.step()
        engine.abort(victims)
        assert all(r.finish_reason == "abort" and not r.pages for r in victims)
        while not keep[0].is_finished:
            engine.step()
    assert keep[0].finish_reason == "length" and keep[0].num_output_tokens == 6
    ref = engine.generate(input_ids=[list(range(3, 23))], sampling_params=params)[0]
    assert keep[0].output_ids == ref.token_ids
    assert _pages_held_by_requests(engine) == 0
    engine.flush_cache()
    assert engine.stats["num_free_pages"] == engine.stats["num_pages"]
    engine.abort(victims)  # aborting finished requests is a no-op
