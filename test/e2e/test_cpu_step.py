"""The CPU step (models/llama_step.py) and the torch attention's fast paths against the module path, fp32."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.models.llama_step import CpuStep, ModuleStep

PROMPTS = ["The capital of France is", "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "def f(x):\n    return"]


def _generate(engine: Engine, prompts, n: int = 12):
    sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
    return engine.generate(prompts, sampling_params=sp)


@pytest.fixture(scope="module")
def engines(tiny_llama_path, monkeypatch_module):
    fast = Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096)
    monkeypatch_module.setenv("DEEPINFER_CPU_FAST_STEP", "0")
    modules = Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096)
    monkeypatch_module.delenv("DEEPINFER_CPU_FAST_STEP")
    yield fast, modules
    fast.shutdown()
    modules.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_step_is_chosen_at_build(engines, tiny_llama_path):
    fast, modules = engines
    assert isinstance(fast.model.step_method, CpuStep)
    assert type(modules.model.step_method) is ModuleStep
    _generate(fast, PROMPTS[:1], 1)
    assert not fast.model.fast_layers[0].takes_row  # fp32 keeps F.linear's mm for more rows (the module path's bits)
    assert fast.model.row_weights  # and a lone fp32 row takes the kernels (DEEPINFER_CPU_FP32_ROW=kernel)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024, batch_invariant=True) as inv:
        assert type(inv.model.step_method) is ModuleStep  # the invariant path keeps its own numerics


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["batch", "single"])
def test_cpu_step_tokens_equal_module_path(engines, prompts):
    fast, modules = engines
    want, got = _generate(modules, prompts), _generate(fast, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("setting", ["kernel", "mm"])
def test_fp32_lone_row_setting(tiny_llama_path, monkeypatch, setting):
    """DEEPINFER_CPU_FP32_ROW: 'kernel' runs a lone fp32 stream's layers as one kernel call each (tokens equal to
    the module path's, logprobs within 1e-5: test_cpu_step_tokens_equal_module_path), 'mm' keeps torch's matmul
    and with it the module path's bits; another value is refused."""
    monkeypatch.setenv("DEEPINFER_CPU_FP32_ROW", setting)
    fused = []
    row_forward = CpuStep._row_forward
    monkeypatch.setattr(CpuStep, "_row_forward", staticmethod(lambda *a: fused.append(1) or row_forward(*a)))
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as engine:
        got = _generate(engine, PROMPTS[:1], 6)
    assert len(fused) == (5 if setting == "kernel" else 0)
    monkeypatch.setenv("DEEPINFER_CPU_FAST_STEP", "0")
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as modules:
        want = _generate(modules, PROMPTS[:1], 6)
    assert got[0].token_ids == want[0].token_ids
    if setting == "mm":
        assert got[0].logprobs == want[0].logprobs
    monkeypatch.setenv("DEEPINFER_CPU_FAST_STEP", "1")
    monkeypatch.setenv("DEEPINFER_CPU_FP32_ROW", "fast")
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as engine:
        (out,) = _generate(engine, PROMPTS[:1], 2)  # read at the first step: that step's requests fail with it
    assert out.finish_reason == "error" and "DEEPINFER_CPU_FP32_ROW='fast': not one of kernel, mm" in out.error


@pytest.mark.parametrize("copies", [1, 3], ids=["whole-qkv-rotation", "q-k-rotation"])
def test_cpu_step_hidden_equal_module_path(engines, copies):
    """One mixed step (a prefill chunk beside decodes would need a scheduler; here: a fresh prefill of several
    sequences) through both trunks on the same weights, bit for bit in fp32; at most _WHOLE_QKV_ROWS tokens the step
    rotates the whole QKV output, above it q | k alone."""
    from deepinfer_rt.models.llama_step import _WHOLE_QKV_ROWS

    fast, modules = engines
    runner = fast.executor
    ids = [fast.tokenizer.encode(p) for p in PROMPTS * copies]
    assert (sum(map(len, ids)) <= _WHOLE_QKV_ROWS) == (copies == 1)
    flat = [t for x in ids for t in x]
    q_lens = [len(x) for x in ids]
    starts = [sum(q_lens[:i]) for i in range(len(ids))]
    slots = [list(range(100 + s, 100 + s + n)) for s, n in zip(starts, q_lens)]
    positions = [p for n in q_lens for p in range(n)]
    out_slots = [s for x in slots for s in x]
    with torch.no_grad():
        fb = runner.forward_batch(flat, positions, out_slots, q_lens, q_lens, slots)
        hidden_fast = fast.model(fb)
        fb = runner.forward_batch(flat, positions, out_slots, q_lens, q_lens, slots)
        hidden_modules = ModuleStep().forward(fast.model, fb)
    assert torch.equal(hidden_fast, hidden_modules)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_reference_bitwise(dtype):
    from deepinfer_kernels import reference
    from deepinfer_rt.models.llama_step import _rms_norm

    g = torch.Generator().manual_seed(0)
    for t, d in ((1, 576), (7, 64), (33, 1536), (2, 4096)):
        x = (torch.randn(t, d, generator=g) * 3).to(dtype)
        w = torch.randn(d, generator=g).to(dtype)
        assert torch.equal(_rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)), (t, d)


@pytest.mark.parametrize("row", ["mv", "linear", "packed", "kernel"])
def test_bf16_row_products_within_rounding(row):
    """Each lone-row product (cpu_row_products.ROW_PRODUCTS) against F.linear: all accumulate in fp32, torch.mv in another
    order, so they agree to about one bf16 rounding of the output (the packed product and F.linear are one library's
    kernels: equal on the CPU measured, not asserted); the 1-D row gives the 2-D row's values; more rows are
    F.linear itself, or the packed copy again under `packed`."""
    from deepinfer_rt.models.cpu_row_products import bf16_linear_fn

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 576, generator=g) * 0.05).bfloat16()
    product = bf16_linear_fn(w, row)
    x = torch.randn(1, 576, generator=g).bfloat16()
    exact = x.double() @ w.double().T
    got, ref = product(x), torch.nn.functional.linear(x, w)
    assert got.shape == ref.shape == (1, 300) and got.dtype == torch.bfloat16
    bound = exact.abs() * 2**-7 + 1e-3  # one bf16 rounding (8 bits of mantissa) plus the fp32 sums' error
    assert ((got.double() - exact).abs() <= bound).all() and ((ref.double() - exact).abs() <= bound).all()
    assert torch.equal(product(x[0]), got[0])  # the 1-D lone-stream form, as it is
    x3 = torch.randn(3, 576, generator=g).bfloat16()
    many, want = product(x3), torch.nn.functional.linear(x3, w)
    if row in ("packed", "kernel"):  # the packed copy / the kernels' product serve more rows too: within the same
        # rounding as F.linear (the kernels: each row's values as the lone row's)
        assert ((many.double() - x3.double() @ w.double().T).abs() <= 2**-7 * want.double().abs() + 1e-3).all()
        if row == "kernel":
            assert torch.equal(many[1], product(x3[1]))
    else:
        assert torch.equal(many, want)


def test_row_gemv_choice(monkeypatch):
    """DEEPINFER_CPU_BF16_GEMV: 'mv' / 'linear' / 'packed' / 'kernel' are taken as given; 'auto' times each once per
    process and leaves F.linear only for one ROW_GEMV_MARGIN faster; 'kernel' where the kernels cannot be built
    is refused under its name and left out of 'auto'; an unknown value is refused."""
    from deepinfer_kernels import cpu_row
    from deepinfer_rt.models import cpu_row_products as products

    monkeypatch.setattr(products, "_ROW_GEMV", {})
    w = torch.randn(64, 32).bfloat16()
    assert [products.choose_row_gemv(w, r) for r in products.ROW_PRODUCTS] == list(products.ROW_PRODUCTS)
    # per round: F.linear, torch.mv, packed, kernel; a near tie (1.1x: F.linear), then the kernel 1.25x the fastest
    timings = iter([1.1, 1.0, 1.05, 1.2, 1.25, 1.2, 1.1, 1.0])
    calls = []
    monkeypatch.setattr(products, "_time_row_product", lambda fn: calls.append(fn) or next(timings))
    assert products.choose_row_gemv(w, "auto") == "linear"
    assert products.choose_row_gemv(w, "auto") == "linear" and len(calls) == 4  # measured once, kept
    monkeypatch.setattr(products, "_ROW_GEMV", {})
    assert products.choose_row_gemv(w, "auto") == "kernel" and len(calls) == 8
    # no compiler here: 'kernel' is refused by name, and 'auto' times the other three
    monkeypatch.setattr(products, "row_kernels", lambda: None)
    monkeypatch.setattr(cpu_row, "error", lambda: "CalledProcessError: no C++ compiler")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_BF16_GEMV=kernel: .* cannot be built here .*no C.. compiler"):
        products.choose_row_gemv(w, "kernel")
    monkeypatch.setattr(products, "_ROW_GEMV", {})
    timings = iter([1.25, 1.2, 1.0])
    assert products.choose_row_gemv(w, "auto") == "packed" and len(calls) == 11
    with pytest.raises(ValueError, match="DEEPINFER_CPU_BF16_GEMV='gemm': not one of auto, linear, mv, packed, kernel"):
        products.choose_row_gemv(w, "gemm")


@pytest.mark.parametrize("gemv", ["mv", "linear", "packed", "kernel"])
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["batch", "single"])
def test_cpu_step_bf16_within_tolerance_of_module_path(tiny_llama_path, monkeypatch, prompts, gemv):
    """bf16: the step's one-row GEMVs (torch.mv or the kernels, where chosen; under 'kernel' a decode step's whole
    layer is one kernel call) and head round differently from the module path's F.linear, so logprobs agree within
    bf16's tolerance (0.1, as the weight-only checks) and the first tokens are equal (a later near-tie may flip)."""
    monkeypatch.setenv("DEEPINFER_CPU_BF16_GEMV", gemv)
    fused = []
    row_forward = CpuStep._row_forward
    monkeypatch.setattr(CpuStep, "_row_forward", staticmethod(lambda *a: fused.append(1) or row_forward(*a)))
    with Engine(str(tiny_llama_path), dtype="bfloat16", kv_cache_tokens=4096) as fast:
        assert isinstance(fast.model.step_method, CpuStep)
        got = _generate(fast, prompts)
        assert fast.model.fast_layers[0].takes_row  # a lone stream's row went through the layers as a 1-D vector
        assert fast.model.row_product == gemv
    # the fused layers ran every decode step under 'kernel' (11 of 12 tokens; the first comes from the prefill),
    # one stream or four decoding together, and never under another product
    assert len(fused) == (11 if gemv == "kernel" else 0)
    monkeypatch.setenv("DEEPINFER_CPU_FAST_STEP", "0")
    with Engine(str(tiny_llama_path), dtype="bfloat16", kv_cache_tokens=4096) as modules:
        assert type(modules.model.step_method) is ModuleStep
        want = _generate(modules, prompts)
    for a, b in zip(got, want):
        assert a.token_ids[:2] == b.token_ids[:2]
        assert max(abs(x - y) for x, y in zip(a.logprobs[:2], b.logprobs[:2])) < 0.1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quantization", ["q4_1", "int8"])
def test_quantized_decode_rows_take_the_kernels(tiny_llama_path, monkeypatch, dtype, quantization):
    """DEEPINFER_CPU_QUANT_ROW=kernel (default), on a CPU with native bf16: a lone stream's and a 3-row batch's
    decode steps run each layer as one kernel call over the 4-bit codes or int8 rows (decode_layer_q), a 5-row
    batch's over the dequantized copies (decode_layer); elsewhere the step keeps torch's packed matmuls. Tokens equal
    those of torch's packed matmuls (DEEPINFER_CPU_QUANT_ROW=torch), logprobs within fp32's / bf16's rounding of
    them. Another value is refused."""
    from deepinfer_kernels import cpu_row
    from deepinfer_rt.layers.kernel_config import cpu_has_native_bf16

    ops = cpu_row.load()
    assert ops is not None, cpu_row.error()
    prompts = ["The capital of France is", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,", "def f(x):", "a b c d"]
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=4)
    row_forward, calls = CpuStep._row_forward, []
    monkeypatch.setattr(CpuStep, "_row_forward",
                        staticmethod(lambda *a: calls.append((a[2].shape[0], a[4])) or row_forward(*a)))
    results = {}
    for setting in ("torch", "kernel"):
        monkeypatch.setenv("DEEPINFER_CPU_QUANT_ROW", setting)
        calls.clear()
        with Engine(str(tiny_llama_path), dtype=dtype, kv_cache_tokens=1024, quantization=quantization) as engine:
            results[setting] = [engine.generate(group, sampling_params=sp) for group in
                                (prompts[:1], prompts[:3], prompts)]
        if setting == "torch" or not cpu_has_native_bf16():
            assert calls == []
        else:  # 7 decode steps of each group
            assert calls.count((1, ops.decode_layer_q)) == 7 and calls.count((3, ops.decode_layer_q)) == 7
            assert calls.count((5, ops.decode_layer)) == 7 and len(calls) == 21
    # the same tokens, the chosen logprobs within the tolerance; where bf16 picks another token, it was a near tie
    # on both sides (the tiny random model's logits are nearly flat: ties within a bf16 step are common)
    tol = 1e-4 if dtype == "float32" else 0.05
    diverged = 0
    for want_group, got_group in zip(results["torch"], results["kernel"]):
        for want, got in zip(want_group, got_group):
            for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
                assert abs(got.logprobs[i] - want.logprobs[i]) < tol, (i, got.logprobs[i], want.logprobs[i])
                if a != b:
                    assert dtype == "bfloat16" and dict(want.top_logprobs[i]).get(a, -1e9) > want.logprobs[i] - tol
                    diverged += 1
                    break
    assert diverged <= 3, diverged
    monkeypatch.setenv("DEEPINFER_CPU_QUANT_ROW", "fast")
    with Engine(str(tiny_llama_path), dtype=dtype, kv_cache_tokens=1024, quantization=quantization) as engine:
        with pytest.raises(ValueError, match="DEEPINFER_CPU_QUANT_ROW='fast'"):
            engine.model.step_method.forward(engine.model, None)


@pytest.fixture(scope="module")
def llama_head_64_path(tmp_path_factory):
    """A tiny llama with the embedded default's head size (64), two kv heads for four q heads."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-head-64"), seed=1, hidden_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def test_bf16_prefill_attention_takes_the_kernel(llama_head_64_path, monkeypatch):
    """bf16 steps that bring a prompt of 16 or more tokens take the kernels' causal attention on a CPU with
    AVX512-BF16 (CpuStep._attention_fn), also for a prompt whose first part is cached (its chunk attends the cached
    keys); decode-only steps keep the backend. Prompt and first-token logprobs within bf16's tolerance of the
    module path's, the first tokens equal."""
    from deepinfer_rt.models import llama_step
    from deepinfer_rt.models.llama_step import _cpu_has_avx512_bf16

    long = "The harbour town woke slowly while the lighthouse keeper climbed the stairs. " * 12
    prompts = [long + "Then", "Hello there, how are you today? I am fine, thank you. And you, my friend?",
               long + "After that the boats came home one by one, their holds full of silver fish and stories."]
    scored = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    plain = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=True)  # prefix cache on
    took = []
    kernels = llama_step.row_kernels()

    class Counting:  # the kernels, with the attention's calls counted (query rows of each)
        def __getattr__(self, name):
            return getattr(kernels, name)

        @staticmethod
        def prefill_attention(*args):
            took.append(args[0].shape[0])
            return kernels.prefill_attention(*args)

    monkeypatch.setattr(llama_step, "row_kernels", lambda: Counting())

    def run(engine):  # the third prompt's first part is the first's, cached
        return ([engine.generate(p, sampling_params=scored)[0] for p in prompts[:2]]
                + [engine.generate(prompts[2], sampling_params=plain)[0]])

    with Engine(str(llama_head_64_path), dtype="bfloat16", kv_cache_tokens=4096) as fast:
        got = run(fast)
        native = fast.model.attention_ops is not None
        layers = fast.model.config.num_layers
    assert native == _cpu_has_avx512_bf16()
    if native:  # each layer of each prefill, the third's only past its cached prefix
        lens = [o.prompt_tokens for o in got]
        assert got[2].cached_tokens > 0 and lens[1] >= 16 and lens[2] - got[2].cached_tokens >= 16
        assert took == [n for n in (lens[0], lens[1], lens[2] - got[2].cached_tokens) for _ in range(layers)]
    else:
        assert took == []
    monkeypatch.setenv("DEEPINFER_CPU_FAST_STEP", "0")
    with Engine(str(llama_head_64_path), dtype="bfloat16", kv_cache_tokens=4096) as modules:
        want = run(modules)
    for a, b in zip(got, want):
        assert a.token_ids[:2] == b.token_ids[:2]
        errors = [abs(x - y) for x, y in zip((a.prompt_logprobs or [None])[1:] + a.logprobs[:2],
                                             (b.prompt_logprobs or [None])[1:] + b.logprobs[:2])]
        assert max(errors) < 0.1, max(errors)
