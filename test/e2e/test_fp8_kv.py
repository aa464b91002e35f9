"""FP8 KV cache (kv_cache_dtype='fp8_e4m3') on CPU, through the torch reference backend: close to the model-dtype
KV, exact between prefix cache on and off (with eviction, chunking and retraction), batch-invariant, and refused
where a model's pool layout does not take it.

Tolerance: e4m3 keeps 3 mantissa bits, so each cached K/V value moves by up to 2^-4 of itself. On the tiny random
models below (teacher-forced over a 200-token random prompt) that moves the prompt tokens' logprobs by
max 0.07 / mean 0.018 (Llama) and max 0.10 / mean 0.020 (dense DeepSeek-V3, MLA latent + rope); the bounds are
about 3x those. MoE models are left out of the closeness check: a perturbed router can pick another expert, a
jump no KV tolerance describes (the tiny MoE V3 shows max 1.2, mean 0.04)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from test_prefix_cache import shared_workload

MAX_DELTA, MEAN_DELTA = 0.3, 0.06


@pytest.fixture(scope="module")
def tiny_dense_v3_path(tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tiny-v3-dense"), seed=0,
                                first_k_dense_replace=4)


def _score(path, kv_cache_dtype: str, prompt: list[int], **kw):
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1, logprobs=True)
    with Engine(str(path), dtype="float32", kv_cache_tokens=1024, kv_cache_dtype=kv_cache_dtype, **kw) as e:
        return e.generate(input_ids=[prompt], sampling_params=sp)[0]


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_dense_v3_path"])
def test_fp8_kv_close_to_model_dtype_kv(request, model):
    path = request.getfixturevalue(model)
    prompt = torch.randint(10, 1000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    ref, fp8 = _score(path, "auto", prompt), _score(path, "fp8_e4m3", prompt)
    a, b = torch.tensor(ref.prompt_logprobs[1:]), torch.tensor(fp8.prompt_logprobs[1:])
    delta = (a - b).abs()
    assert delta.max() < MAX_DELTA and delta.mean() < MEAN_DELTA, (delta.max(), delta.mean())
    # greedy agreement, teacher-forced: the most likely next token at each prompt position
    top = lambda o: [t[0][0] for t in o.prompt_top_logprobs[1:]]
    agree = sum(x == y for x, y in zip(top(ref), top(fp8))) / len(prompt[1:])
    assert agree >= 0.85, agree
    assert ref.token_ids[0] == fp8.token_ids[0] or abs(ref.logprobs[0] - fp8.logprobs[0]) < MAX_DELTA


@pytest.mark.parametrize("model,kwargs", [
    ("tiny_llama_path", dict(kv_cache_tokens=300, chunked_prefill_tokens=16)),  # eviction, chunks, retraction
    ("tiny_llama_path", dict(page_size=4, kv_cache_tokens=600)),
    ("tiny_v3_path", dict(kv_cache_tokens=300, chunked_prefill_tokens=16)),
])
def test_fp8_kv_cache_on_equals_cache_off(request, model, kwargs):
    path = request.getfixturevalue(model)
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with Engine(str(path), dtype="float32", enable_prefix_cache=False, kv_cache_tokens=8192,
                kv_cache_dtype="fp8_e4m3") as off:
        prompts = shared_workload(off.model_config.vocab_size, seed=0)[:16]
        expected = [o.token_ids for o in off.generate(input_ids=prompts, sampling_params=sp)]
    with Engine(str(path), dtype="float32", kv_cache_dtype="fp8_e4m3", **kwargs) as on:
        outs = []
        for i in range(0, len(prompts), 6):  # waves: later ones hit what earlier ones cached
            outs += on.generate(input_ids=prompts[i : i + 6], sampling_params=sp)
        assert [o.token_ids for o in outs] == expected
        assert sum(o.cached_tokens for o in outs) > 0
        assert on.pool.is_fp8


def test_fp8_kv_retraction_exact(tiny_llama_path):
    """A pool too small for the batch retracts requests and recomputes their KV: same tokens as a roomy pool."""
    prompts = [list(range(20 + i, 60 + i)) for i in range(6)]
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for tokens in (4096, 160):
        with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=tokens, kv_cache_dtype="fp8_e4m3",
                    enable_prefix_cache=False) as e:
            runs[tokens] = ([o.token_ids for o in e.generate(input_ids=prompts, sampling_params=sp)],
                            e.stats["num_retractions"])
    assert runs[160][1] > 0 and runs[4096][1] == 0
    assert runs[160][0] == runs[4096][0]


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_v3_path"])
def test_fp8_kv_batch_invariant(request, model):
    path = request.getfixturevalue(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (30, 7, 52, 18)]
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, kv_cache_dtype="fp8_e4m3",
                batch_invariant=True, enable_prefix_cache=False) as e:
        alone = e.generate(input_ids=[prompts[0]], sampling_params=sp)[0]
        together = e.generate(input_ids=prompts, sampling_params=sp)[0]
    assert together.token_ids == alone.token_ids and together.logprobs == alone.logprobs


def test_fp8_kv_refusals(tiny_llama_path, tiny_v4_path, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=64, kv_cache_dtype="fp8_e5m2")
    # DeepSeek-V4's per-token layout keeps other state in its rows (its compact pool has an FP8 form of its own).
    monkeypatch.setenv("DEEPINFER_V4_KV_LAYOUT", "per_token")
    with pytest.raises(ValueError, match="not supported by this model's KV layout"):
        Engine(str(tiny_v4_path), dtype="float32", kv_cache_tokens=64, kv_cache_dtype="fp8_e4m3")
