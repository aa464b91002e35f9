"""The compiled CPU step (DEEPINFER_CPU_COMPILE=1, models/llama_compiled.py) against the eager CPU step, fp32.

The one test here that compiles is the CI's only torch.compile run (a cold compile takes tens of seconds; inductor's
cache under DEEPINFER_CACHE/inductor makes later runs fast)."""
from __future__ import annotations

import os


from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.models.llama_compiled import CompiledCpuStep
from deepinfer_rt.models.llama_step import CpuStep

PROMPTS = ["The capital of France is", "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]


def test_compiled_step_chosen_only_where_it_runs(tiny_llama_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE", "1")
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=512, quantization="int8") as q8:
        assert type(q8.model.step_method) is CpuStep  # quantized linears stay eager
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=512, batch_invariant=True) as inv:
        assert not isinstance(inv.model.step_method, CpuStep)  # batch-invariant keeps the module path


def test_compiled_step_tokens_equal_eager(tiny_llama_path, monkeypatch):
    sp = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=2048) as eager:
        assert type(eager.model.step_method) is CpuStep
        # a batch (prefill of several sequences, then T >= 2 decode steps) and a lone stream (T = 1 decode)
        want = [eager.generate(PROMPTS, sampling_params=sp), eager.generate(PROMPTS[:1], sampling_params=sp)]
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE", "1")
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=2048) as compiled:
        step = compiled.model.step_method
        assert isinstance(step, CompiledCpuStep)
        got = [compiled.generate(PROMPTS, sampling_params=sp), compiled.generate(PROMPTS[:1], sampling_params=sp)]
        assert step.is_compiled, "the compiled step fell back to eager"
    for outs_got, outs_want in zip(got, want):
        assert [o.token_ids for o in outs_got] == [o.token_ids for o in outs_want]
        for a, b in zip(outs_got, outs_want):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_compiler_failure_falls_back_to_eager(tiny_llama_path, monkeypatch, caplog):
    """Without a working C++ toolchain the step warns once and computes eagerly (no compile runs here)."""
    import torch._inductor.exc

    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as eager:
        want = [o.token_ids for o in eager.generate(PROMPTS, sampling_params=sp)]
    monkeypatch.setenv("DEEPINFER_CPU_COMPILE", "1")
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as e:
        step = e.model.step_method
        broken = CompiledCpuStep(CpuStep())  # its own flag: the shared step of other engines stays as it is

        def no_compiler(*args, **kwargs):
            raise torch._inductor.exc.CppCompileError(["g++"], "g++: not found")

        monkeypatch.setattr(broken, "enter", no_compiler)
        monkeypatch.setattr(e.model, "step_method", broken)
        got = [o.token_ids for o in e.generate(PROMPTS, sampling_params=sp)]
        assert not broken.is_compiled and step is not broken
    assert got == want
    assert sum("running the eager step" in r.message for r in caplog.records) == 1


def test_inductor_cache_under_deepinfer_cache(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from deepinfer_rt.models.llama_compiled import _use_our_inductor_cache

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing inductor writes there
    _use_our_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice stays
    _use_our_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
