"""Speculation through the EP worker pool (CPU, gloo): drafts planned in the engine process, verified in the
worker serving the request. Random tiny models rarely repeat themselves, so the drafter is the oracle of
test_speculative.py (the reference continuation, some positions corrupted: partial acceptance and rollback
every step). Tokens equal the engine's without speculation, and the drafted/accepted counts equal the
single-process engine's with the same drafter, at EP=1 (one worker) and EP=2 (data-parallel attention)."""
from __future__ import annotations

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig

from test_speculative import OracleDrafter, add_mtp_layer

PROMPTS = [[5, 17, 300, 9, 17, 300, 9, 44, 81, 2000], [100, 200, 300, 400, 100, 200, 7, 8],
           list(range(1000, 1040)), [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]]
PARAMS = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True)]


def _run(path, speculative=None, **kwargs):
    with Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=1024, speculative=speculative,
                **kwargs) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        return [o.token_ids for o in outs], engine.stats.get("spec")


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    plain, _ = _run(tiny_v3_path)
    # fixed_length: draft lengths that do not follow the measured step time, so the counts compare across runs
    oracle = SpeculativeConfig(drafter=OracleDrafter({tuple(p): o for p, o in zip(PROMPTS, plain)}), max_draft=4,
                               fixed_length=True)
    speculated, stats = _run(tiny_v3_path, oracle)
    assert speculated == plain and 0 < stats["accepted"] < stats["drafted"], stats
    return plain, oracle, stats


@pytest.mark.parametrize("ep_size", [1, 2])
def test_speculation_under_ep_equals_speculation_without(tiny_v3_path, reference, monkeypatch, ep_size):
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    plain, oracle, stats = reference
    outs, ep_stats = _run(tiny_v3_path, oracle, ep_size=ep_size)
    assert outs == plain
    assert ep_stats == stats


def test_mtp_without_an_mtp_layer_is_refused_before_workers_start(tiny_llama_path):
    with pytest.raises(ValueError, match="speculative='mtp' needs a DeepSeek-V3 model"):
        Engine(str(tiny_llama_path), dtype="float32", ep_size=1, speculative="mtp")


# ---- MTP: drafted in the workers after each verify step, its MoE layer joining every rank's collectives ----

MTP = SpeculativeConfig("mtp", fixed_length=True, max_draft=3)


@pytest.fixture(scope="module")
def mtp_path(tiny_v3_path, tmp_path_factory):
    return add_mtp_layer(tiny_v3_path, tmp_path_factory.mktemp("ep-mtp") / "ckpt")


@pytest.fixture(scope="module")
def mtp_reference(mtp_path):
    plain, _ = _run(mtp_path, max_num_seqs=8)
    speculated, stats = _run(mtp_path, MTP, max_num_seqs=8)
    greedy = [i for i, p in enumerate(PARAMS) if p.temperature == 0]
    assert [speculated[i] for i in greedy] == [plain[i] for i in greedy]
    assert 0 < stats["accepted"] < stats["drafted"], stats
    return plain, speculated, stats


@pytest.mark.parametrize("ep_size", [1, 2])
def test_mtp_under_ep_equals_mtp_in_process(mtp_path, mtp_reference, monkeypatch, ep_size):
    """Greedy requests give the tokens of no speculation; the seeded sampled one (rejection sampling against
    the worker's own draft distribution) those of in-process MTP; fixed-length drafts make the drafted and
    accepted counts the in-process engine's. At EP=2 the four requests spread over both ranks, one rank
    drafting while the other may have nothing to draft."""
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    plain, speculated, stats = mtp_reference
    outs, ep_stats = _run(mtp_path, MTP, ep_size=ep_size, max_num_seqs=8)
    assert outs == speculated
    assert ep_stats == stats


def test_mtp_with_an_idle_rank_and_chunked_prefill(mtp_path):
    """One request at EP=2: the other rank runs every step empty, the MTP forward and its chain included; the
    prompt's first chunks sample nothing (no chain forwards that step)."""
    prompt, params = [list(range(1000, 1040))], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)

    def run(**kwargs):
        with Engine(str(mtp_path), dtype="float32", page_size=4, kv_cache_tokens=1024, max_num_seqs=4,
                    chunked_prefill_tokens=16, speculative=MTP, **kwargs) as engine:
            (out,) = engine.generate(input_ids=prompt, sampling_params=params)
            return out.token_ids, engine.stats["spec"]

    tokens, stats = run()
    assert stats["drafted"] > 0
    assert run(ep_size=2) == (tokens, stats)


def test_mtp_batch_invariant_under_ep_equals_in_process(mtp_path, monkeypatch):
    """Batch-invariant mode (fixed-length drafts, fixed-tile expert GEMMs): EP=2's tokens and drafted/accepted
    counts are the in-process engine's (EP=4 too, checked by hand: slow on a small CPU)."""
    monkeypatch.setenv("DEEPINFER_EP_STEP_TIMEOUT", "180")  # the batch-invariant CPU kernels are slow
    # fixed_length: on with batch_invariant. Five drafts: a verify step's 6 tokens span up to 3 pages of 4, so a
    # rejection cuts two pages, which the workers' page mirrors must follow (distributed/mirrors.py).
    mtp = SpeculativeConfig("mtp", max_draft=5)
    expected = _run(mtp_path, mtp, batch_invariant=True, max_num_seqs=8)
    assert expected[1]["drafted"] > 0
    assert _run(mtp_path, mtp, batch_invariant=True, max_num_seqs=8, ep_size=2) == expected
