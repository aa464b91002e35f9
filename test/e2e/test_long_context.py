"""Long contexts on CPU with tiny models: decode at a 4K-token context equals transformers token for token,
chunked or not, from the prefix cache or computed, at page sizes 1 and 16; and the host work of a decode step
does not grow with the context.

Host work is counted without clocks (two CPU cores are shared, times are noise): the Python lines the engine
runs in one decode step (sys.settrace over deepinfer_rt's files), the most memory Python objects take during
it (tracemalloc: a list or array of the context's tokens, pages or slots would show as its size) and the host
values turned into tensors (torch.tensor / numpy.fromiter, the ways a host list reaches the device). On CPU
the torch computation runs on the host too, but it is the device's work and torch's memory is not traced.
"""
from __future__ import annotations

import sys
import tracemalloc

import numpy as np
import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig
from deepinfer_rt.speculative.drafter import Drafter, Proposal

LONG = 4096


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama-long"), seed=3,
                                max_position_embeddings=16384)


@pytest.fixture(scope="module")
def long_hf(long_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(long_llama, dtype=torch.float32).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = _prompt(LONG, 0)
SHARED = PROMPT[:3072] + _prompt(LONG - 3072, 1)
"""Shares the first 3K tokens of PROMPT: a cache hit at a long offset, then a fresh tail."""


@pytest.fixture(scope="module")
def references(long_hf) -> dict[str, list[int]]:
    return {"prompt": _hf_greedy(long_hf, PROMPT, 6), "shared": _hf_greedy(long_hf, SHARED, 6)}


@pytest.mark.parametrize("page_size,chunk", [(1, 8192), (1, 1000), (16, 1000)])
def test_long_context_decode_equals_transformers(long_llama, references, page_size, chunk):
    """A 4K-token prompt, prefilled whole or in chunks at long offsets; then a second request sharing its
    first 3K tokens and the same prompt again (a full hit)."""
    prompt, shared = PROMPT, SHARED
    with Engine(str(long_llama), dtype="float32", kv_cache_tokens=3 * LONG, page_size=page_size,
                chunked_prefill_tokens=chunk, max_num_seqs=4) as engine:
        first = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
        hit = engine.generate(input_ids=[shared, prompt], sampling_params=GREEDY)
    assert first.cached_tokens == 0
    assert hit[0].cached_tokens >= 3072 - page_size and hit[1].cached_tokens >= LONG - page_size
    assert first.token_ids == references["prompt"]
    assert hit[1].token_ids == references["prompt"]
    assert hit[0].token_ids == references["shared"]


class _Conversions:
    """Counts the host values turned into tensors while active."""

    def __init__(self):
        self.num_values = 0
        self._tensor, self._fromiter = torch.tensor, np.fromiter

    def __enter__(self):
        def tensor(data, *args, **kwargs):
            if isinstance(data, (list, tuple)):
                self.num_values += sum(len(x) if isinstance(x, (list, tuple)) else 1 for x in data)
            return self._tensor(data, *args, **kwargs)

        def fromiter(values, dtype, count=-1, **kwargs):
            self.num_values += count if count >= 0 else 0
            return self._fromiter(values, dtype, count, **kwargs)

        torch.tensor, np.fromiter = tensor, fromiter
        return self

    def __exit__(self, *exc):
        torch.tensor, np.fromiter = self._tensor, self._fromiter


DECODE = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, stop=["never here"],
                        repetition_penalty=1.1, logprobs=True)


def _decode_step_work(engine: Engine, context: int, params: SamplingParams = DECODE, num_emitted: int = 1
                      ) -> tuple[int, int, int, int]:
    """(Python lines of deepinfer_rt run, peak bytes of Python allocations, pages uploaded, host values made
    tensors) in one decode step of a batch of two requests at `context` tokens, once both are decoding; each
    request emits `num_emitted` tokens in it."""
    with engine.hold_loop():
        reqs = [engine.add_request(_prompt(context, s), params)[0] for s in (5, 6)]
        while not all(r.num_output_tokens >= 2 for r in reqs):
            engine.step()
        lines = [0]
        package = "deepinfer_rt"

        def tracer(frame, event, arg):
            if package not in frame.f_code.co_filename:
                return None
            if event == "line":
                lines[0] += 1
            return tracer

        uploaded = engine.executor.stats()["num_uploaded_pages"]
        before = [r.num_output_tokens for r in reqs]
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        sys.settrace(tracer)
        try:
            with _Conversions() as conversions:
                engine.step()
        finally:
            sys.settrace(None)
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        uploaded = engine.executor.stats()["num_uploaded_pages"] - uploaded
        assert [r.num_output_tokens for r in reqs] == [n + num_emitted for n in before], (before, reqs)
        assert not any(r.is_finished for r in reqs)
        while not all(r.is_finished for r in reqs):
            engine.step()
    return lines[0], peak, uploaded, conversions.num_values


def test_decode_step_host_work_does_not_grow_with_context(long_llama, single_thread):
    """256 vs 8K tokens of context (32x), with penalties, logprobs and a stop string: the same lines run, the
    same page uploads (the one new page each), the same host values made tensors, and no allocation the size of
    a context (8K entries are >= 64 KB as a list, 32 KB as int32)."""
    with Engine(str(long_llama), dtype="float32", kv_cache_tokens=2 * 8192 + 64, max_num_seqs=2,
                chunked_prefill_tokens=8192, enable_prefix_cache=True) as engine:
        short = _decode_step_work(engine, 256)
        long = _decode_step_work(engine, 8192)
    lines_short, peak_short, up_short, values_short = short
    lines_long, peak_long, up_long, values_long = long
    assert up_short == up_long == 2, (short, long)
    assert values_long == values_short, (short, long)
    assert lines_long <= lines_short * 1.05 + 20, (short, long)
    assert peak_long <= peak_short + 16 * 1024, (short, long)


class _KnownContinuation(Drafter):
    """Drafts the continuation a plain greedy run produced (recorded by prompt), so every draft is accepted and
    a step emits the same number of tokens at any context."""

    def __init__(self, num_draft: int):
        self.num_draft = num_draft
        self.continuations: dict[tuple[int, ...], list[int]] = {}

    def propose(self, req, k):
        done = self.continuations.get(tuple(req.prompt_ids[:16]))
        if done is None:
            return None
        tokens = done[req.num_output_tokens : req.num_output_tokens + k]
        return Proposal(tokens, [1.0] * len(tokens), None, req.num_tokens) if tokens else None


SPEC_DECODE = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=["never here"],
                             repetition_penalty=1.1)


def _spec_step_work(engine: Engine, drafter: _KnownContinuation, context: int) -> tuple[int, int, int, int]:
    """_decode_step_work for a step verifying num_draft drafts per request, all accepted (the prompts' plain
    greedy continuation is recorded first, drafts off; the measured run reuses the prompts' cached KV)."""
    for s in (5, 6):
        prompt = _prompt(context, s)
        out = engine.generate(input_ids=[prompt], sampling_params=SPEC_DECODE)[0]
        drafter.continuations[tuple(prompt[:16])] = out.token_ids
    return _decode_step_work(engine, context, SPEC_DECODE, num_emitted=drafter.num_draft + 1)


def test_speculative_step_host_work_does_not_grow_with_context(long_llama, single_thread):
    """As above for a step that verifies 3 drafts per request: its tokens, slots, penalties and verification
    rows are the batch's new tokens; nothing of the context is built on the host."""
    drafter = _KnownContinuation(num_draft=3)
    spec = SpeculativeConfig(drafter=drafter, max_draft=3, fixed_length=True)
    with Engine(str(long_llama), dtype="float32", kv_cache_tokens=2 * 8192 + 256, max_num_seqs=2,
                chunked_prefill_tokens=8192, enable_prefix_cache=True, speculative=spec) as engine:
        short = _spec_step_work(engine, drafter, 256)
        long = _spec_step_work(engine, drafter, 8192)
    lines_short, peak_short, up_short, values_short = short
    lines_long, peak_long, up_long, values_long = long
    assert up_long == up_short == 2 * 4, (short, long)  # page size 1: a page per verified token
    assert values_long == values_short, (short, long)
    assert lines_long <= lines_short * 1.05 + 20, (short, long)
    assert peak_long <= peak_short + 16 * 1024, (short, long)
