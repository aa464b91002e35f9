"""The lone-row CPU kernels (kernels/cpu/row_decode.cpp) against torch: the product, in its AVX512-BF16 and
portable forms and in fp32, and one whole layer against the eager step's operations (models/llama_step.py) in
bf16 and fp32 on random weights, shapes that are not multiples of the kernels' vector widths, GQA, and scattered
slots."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels import cpu_row
from deepinfer_rt.models.llama_step import _rms_norm


@pytest.fixture(scope="module")
def ops():
    ops = cpu_row.load()
    assert ops is not None, f"the CPU kernels did not build: {cpu_row.error()}"
    return ops


@pytest.fixture(params=[True, False], ids=["avx512bf16", "portable"])
def native(request, ops):
    """Both forms of the products; the AVX512-BF16 one where this CPU has it (else both runs are portable)."""
    previous = ops.set_native_bf16(request.param)
    yield request.param
    ops.set_native_bf16(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(300, 576), (37, 100), (5, 31), (1, 1536), (129, 64)])
def test_gemv_within_fp32_sums_of_exact(ops, native, n, k, dtype):
    g = torch.Generator().manual_seed(n * k)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(k, generator=g).to(dtype)
    exact = w.double() @ x.double()
    sums = ops.gemv(x, w, False)
    assert sums.dtype == torch.float32 and sums.shape == (n,)
    # fp32 sums (of exact products for bf16: bf16 x bf16 fits fp32): error within ~k roundings of the running sum
    bound = 2 * k * 2**-24 * (w.double().abs() @ x.double().abs()) + 1e-6
    assert ((sums.double() - exact).abs() <= bound).all()
    if dtype == torch.bfloat16:
        rounded = ops.gemv(x, w, True)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, sums.bfloat16())


def test_gemv_refuses_what_it_cannot_take(ops):
    x = torch.randn(64).bfloat16()
    with pytest.raises(RuntimeError, match=r"contiguous BFloat16 \(N, 64\) weight expected, got Float"):
        ops.gemv(x, torch.randn(8, 64), False)  # fp32 weight, bf16 row
    with pytest.raises(RuntimeError, match=r"contiguous BFloat16 \(N, 64\) weight"):
        ops.gemv(x, torch.randn(64, 8).bfloat16().t(), False)  # transposed: not contiguous
    with pytest.raises(RuntimeError, match="bf16 or fp32 values expected"):
        ops.gemv(torch.ones(64, dtype=torch.int32), torch.ones(8, 64, dtype=torch.int32), False)
    with pytest.raises(RuntimeError, match="bf16_out takes bf16 inputs"):
        ops.gemv(torch.randn(64), torch.randn(8, 64), True)


def _reference_layer(x, residual, first, weights, cos, signed_sin, k_cache, v_cache, slots, out_slot, num_q,
                     num_kv, eps, scale):
    """The eager bf16 step's operations for one lone row (CpuStep.forward), with SDPA over the gathered slots."""
    in_norm, post_norm, qkv_w, o_w, gate_up_w, down_w = weights
    d, inter = cos.numel(), down_w.shape[1]
    residual = x.clone() if first else x + residual
    qkv = F.linear(_rms_norm(residual[None], in_norm, eps), qkv_w).view(num_q + 2 * num_kv, d)
    qk = qkv[: num_q + num_kv]
    qk = qk * cos + qk.roll(d // 2, dims=-1) * signed_sin
    q, k, v = qk[:num_q], qk[num_q:], qkv[num_q + num_kv:]
    k_cache[out_slot], v_cache[out_slot] = k, v
    keys, values = k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q[None, :, None], keys, values, scale=scale, enable_gqa=True)
    residual = F.linear(o.reshape(1, -1), o_w) + residual
    gate, up = F.linear(_rms_norm(residual, post_norm, eps), gate_up_w).split(inter, dim=-1)
    return F.linear(F.silu(gate) * up, down_w)[0], residual[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden, heads, head_dim, inter, context", [
    (576, (9, 3), 64, 1536, 200),   # the embedded default's layer
    (72, (4, 2), 18, 40, 7),        # widths below and between the vector lengths
    (64, (2, 2), 32, 96, 1),        # one key: the token itself
    (128, (8, 1), 128, 64, 1100),   # several chunks of keys (the chunked attention), one kv head for eight
    (96, (3, 3), 64, 32, 513),      # a lone key in the last chunk, no grouping
])
def test_decode_layer_against_eager_step(ops, native, hidden, heads, head_dim, inter, context, dtype):
    num_q, num_kv = heads
    g = torch.Generator().manual_seed(hidden + context)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    weights = (1 + rand(hidden, s=0.1), 1 + rand(hidden, s=0.1), rand((num_q + 2 * num_kv) * head_dim, hidden, s=0.1),
               rand(hidden, num_q * head_dim, s=0.1), rand(2 * inter, hidden, s=0.1), rand(hidden, inter, s=0.1))
    angle = torch.rand(head_dim // 2, generator=g) * 6
    cos = torch.cat([angle.cos(), angle.cos()]).to(dtype)
    signed_sin = torch.cat([-angle.sin(), angle.sin()]).to(dtype)
    pool = 3 * context + 5
    k_cache, v_cache = rand(pool, num_kv, head_dim), rand(pool, num_kv, head_dim)
    slots = torch.randperm(pool, generator=g)[:context]  # a context scattered over the pool, the new token last
    out_slot = int(slots[-1])
    eps, scale = 1e-5, head_dim**-0.5
    for first in (True, False):
        x, residual = rand(hidden), rand(hidden)
        kr, vr = k_cache.clone(), v_cache.clone()
        want_x, want_residual = _reference_layer(x, residual, first, weights, cos, signed_sin, kr, vr, slots,
                                                 out_slot, num_q, num_kv, eps, scale)
        kk, vk = k_cache.clone(), v_cache.clone()
        x, residual = x[None], residual[None]  # one row
        ops.decode_layer(x, residual, first, *weights, cos[None], signed_sin[None], kk, vk, slots,
                         torch.tensor([0, context]), torch.tensor([out_slot]), num_q, num_kv, eps, scale)
        x, residual = x[0], residual[0]
        # nothing but the new token's slot changed; its k (after rotary) and v within a rounding or two of bf16
        # (fp32: the same operations, sums in another order)
        others = torch.ones(pool, dtype=torch.bool)
        others[out_slot] = False
        assert torch.equal(kk[others], k_cache[others]) and torch.equal(vk[others], v_cache[others])
        rel = 2**-6 if dtype == torch.bfloat16 else 1e-4
        for got, want in ((kk[out_slot], kr[out_slot]), (vk[out_slot], vr[out_slot]),
                          (residual, want_residual), (x, want_x)):
            tol = rel * want.float().abs() + rel * want.float().abs().max()
            assert ((got.float() - want.float()).abs() <= tol).all(), (got - want).abs().max()
        cosine = F.cosine_similarity(x.double(), want_x.double(), dim=0)
        assert cosine > 1 - 1e-4 and math.isfinite(x.double().norm().item())


def test_decode_layer_refuses_bad_input(ops):
    hidden, d = 64, 32
    weights = (torch.ones(hidden).bfloat16(), torch.ones(hidden).bfloat16(),
               torch.zeros(4 * d, hidden).bfloat16(), torch.zeros(hidden, 2 * d).bfloat16(),
               torch.zeros(64, hidden).bfloat16(), torch.zeros(hidden, 32).bfloat16())
    cos, sin = torch.ones(1, d).bfloat16(), torch.zeros(1, d).bfloat16()
    k, v = torch.zeros(8, 1, d).bfloat16(), torch.zeros(8, 1, d).bfloat16()
    x, r = torch.zeros(1, hidden).bfloat16(), torch.zeros(1, hidden).bfloat16()
    one, first = torch.tensor([0]), torch.tensor([0, 1])

    def call(slots=one, starts=first, out=one, kc=k, num_q=2, xx=x):
        ops.decode_layer(xx, r, True, *weights, cos, sin, kc, v, slots, starts, out, num_q, 1, 1e-5, 0.1)

    with pytest.raises(RuntimeError, match="slot 9 outside the pool"):
        call(slots=torch.tensor([0, 9]), starts=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="out_slot 8 outside the pool"):
        call(out=torch.tensor([8]))
    with pytest.raises(RuntimeError, match="kv cache"):
        call(kc=k.float())
    with pytest.raises(RuntimeError, match="qkv"):
        call(num_q=3)
    with pytest.raises(RuntimeError, match="slot_starts: from 0 to the 1 slots"):
        call(starts=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="slot_starts: B . 1 = 2 entries"):
        call(starts=torch.tensor([0]))
    with pytest.raises(RuntimeError, match="contiguous int64 vectors"):
        call(slots=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="x .B, H. and cos .B, D. expected"):
        call(xx=x[0])
    assert torch.equal(k, torch.zeros_like(k))  # nothing was written by a refused call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [16, 64])
def test_decode_layer_rows_are_each_row_alone(ops, native, dtype, d):
    """B rows in one call (each its own context, slots and position): every row's x, residual and K/V are the ones
    it gets alone, bit for bit. Head size 64 takes the chunked attention (where the CPU has AVX512-BF16): contexts
    of one chunk, one key past it, and several."""
    hidden, (num_q, num_kv), inter = 96, (4, 2), 80
    g = torch.Generator().manual_seed(11)

    def rand(*shape, s=0.1):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    weights = (1 + rand(hidden), 1 + rand(hidden), rand((num_q + 2 * num_kv) * d, hidden), rand(hidden, num_q * d),
               rand(2 * inter, hidden), rand(hidden, inter))
    lens = [1, 5, 17, 3, 40, 2, 9, 1, 33, 8, 60] + ([256, 257, 700] if d == 64 else [])
    rows, pool = len(lens), sum(lens) + 50
    cos, signed_sin = rand(rows, d, s=1.0), rand(rows, d, s=1.0)
    k_cache, v_cache = rand(pool, num_kv, d, s=1.0), rand(pool, num_kv, d, s=1.0)
    perm = torch.randperm(pool, generator=g)
    contexts, at = [], 0
    for n in lens:
        contexts.append(perm[at:at + n])
        at += n
    x, residual = rand(rows, hidden, s=1.0), rand(rows, hidden, s=1.0)
    out_slots = torch.stack([c[-1] for c in contexts])
    kb, vb, xb, rb = k_cache.clone(), v_cache.clone(), x.clone(), residual.clone()
    ops.decode_layer(xb, rb, False, *weights, cos, signed_sin, kb, vb, torch.cat(contexts),
                     torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), out_slots, num_q, num_kv, 1e-5, 0.25)
    for i, c in enumerate(contexts):
        k1, v1, x1, r1 = k_cache.clone(), v_cache.clone(), x[i:i + 1].clone(), residual[i:i + 1].clone()
        ops.decode_layer(x1, r1, False, *weights, cos[i:i + 1], signed_sin[i:i + 1], k1, v1, c,
                         torch.tensor([0, len(c)]), out_slots[i:i + 1], num_q, num_kv, 1e-5, 0.25)
        assert torch.equal(x1[0], xb[i]) and torch.equal(r1[0], rb[i]), i
        assert torch.equal(k1[c[-1]], kb[c[-1]]) and torch.equal(v1[c[-1]], vb[c[-1]]), i


def test_threads_split_rows_not_sums(ops):
    """Each row's sum runs on one thread: the values do not depend on how many threads take part
    (torch.set_num_threads), and a section on more threads than before starts new workers."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(1000, 320, generator=g).bfloat16(), torch.randn(320, generator=g).bfloat16()
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 1):
            torch.set_num_threads(threads)
            results.append(ops.gemv(x, w, False))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_rows_are_independent_of_how_many_share_the_call(ops, native, dtype):
    """x (M, K): each row's sums are the lone row's, bit for bit, for every M (the kernel takes eight rows at a
    time, the same steps for each), and within the fp32 sums' error of the exact product."""
    g = torch.Generator().manual_seed(3)
    for k in (576, 100, 31):
        w = torch.randn(67, k, generator=g).to(dtype)
        x = torch.randn(19, k, generator=g).to(dtype)
        lone = torch.stack([ops.gemv(row.contiguous(), w, False) for row in x])
        for m in (1, 2, 7, 8, 9, 16, 19):
            got = ops.gemv(x[:m].contiguous(), w, False)
            assert got.shape == (m, 67) and torch.equal(got, lone[:m]), (k, m)
        exact = x.double() @ w.double().T
        bound = 2 * k * 2**-24 * (x.double().abs() @ w.double().abs().T) + 1e-6
        assert ((lone.double() - exact).abs() <= bound).all()
    with pytest.raises(RuntimeError, match=r"contiguous \(K,\) or \(M, K\) input"):
        ops.gemv(x.t(), w, False)


def _q4(weight):
    """A float weight quantized to Q4_1 -> (the kernels' [codes, d, c], the matrix it stands for in fp32)."""
    from deepinfer_rt.layers.q4 import dequantize_q4_1, kernel_rows, quantize_q4_1

    codes, d, m = quantize_q4_1(weight)
    return list(kernel_rows(codes, d, m)), dequantize_q4_1(codes, d, m)


def test_q4_kernel_rows_pack_as_gguf_does():
    """Byte j of a block holds code j (low nibble) and code j + 16 (high nibble); c = m - 16 d."""
    from deepinfer_rt.layers.q4 import kernel_rows

    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    d, m = torch.tensor([[0.5, 2.0]]).half(), torch.tensor([[-1.0, 3.0]]).half()
    packed, scale, c = kernel_rows(codes, d, m)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    assert packed[0, 0] == 0 | (0 << 4) and packed[0, 1] == 1 | (1 << 4) and packed[0, 15] == 15 | (15 << 4)
    block = torch.randint(0, 16, (1, 32), dtype=torch.uint8)
    p = kernel_rows(block, d[:, :1], m[:, :1])[0][0]
    assert torch.equal(torch.cat([p & 15, p >> 4]), block[0])
    assert torch.equal(scale, d.float()) and torch.equal(c, m.float() - 16 * d.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(300, 576), (37, 64), (1, 1536), (129, 32)])
def test_q4_gemv_within_fp32_sums_of_exact(ops, native, n, k, dtype):
    """The 4-bit product against the exact product with the dequantized matrix, within fp32 sums' error; each row's
    values the same whatever rows share the call."""
    g = torch.Generator().manual_seed(n + k)
    q4, dense = _q4(torch.randn(n, k, generator=g) * 0.1)
    x = torch.randn(9, k, generator=g).to(dtype)
    exact = x.double() @ dense.double().T
    # products and per-block sums in fp32 (the codes enter as 16 + q: about 5 bits more of cancellation)
    bound = 64 * k * 2**-24 * (x.double().abs() @ (dense.double().abs() + 16 * q4[1].double().abs()
                                                   .repeat_interleave(32, dim=1)).T) + 1e-6
    lone = torch.stack([ops.q4_gemv(row.contiguous(), *q4, False) for row in x])
    assert lone.dtype == torch.float32 and lone.shape == (9, n)
    assert ((lone.double() - exact).abs() <= bound).all(), (lone.double() - exact).abs().max()
    for m in (2, 8, 9):
        assert torch.equal(ops.q4_gemv(x[:m].contiguous(), *q4, False), lone[:m]), m
    if dtype == torch.bfloat16:
        assert torch.equal(ops.q4_gemv(x[0].contiguous(), *q4, True), lone[0].bfloat16())


def test_q4_gemv_refuses_what_it_cannot_take(ops):
    q4, _ = _q4(torch.randn(8, 64))
    x = torch.randn(64).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_gemv(torch.randn(48).bfloat16(), q4[0][:, :24].contiguous(), q4[1], q4[2], False)
    with pytest.raises(RuntimeError, match=r"contiguous uint8 codes \(N, 32\)"):
        ops.q4_gemv(x, q4[0].to(torch.int8), q4[1], q4[2], False)
    with pytest.raises(RuntimeError, match=r"contiguous fp32 scales \(8, 2\)"):
        ops.q4_gemv(x, q4[0], q4[1].half(), q4[2], False)
    with pytest.raises(RuntimeError, match=r"contiguous fp32 scales \(8, 2\)"):
        ops.q4_gemv(x, q4[0], q4[1], q4[2][:4], False)
    with pytest.raises(RuntimeError, match="bf16_out takes bf16 inputs"):
        ops.q4_gemv(x.float(), *q4, True)


def _int8(weight):
    """A float weight quantized to per-row int8 -> (the kernels' [q, scale], the matrix it stands for in fp32)."""
    from deepinfer_rt.layers.int8 import quantize_rows

    q, scale = quantize_rows(weight)
    return [q, scale], q.float() * scale[:, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(300, 576), (37, 100), (1, 1536), (129, 31)])
def test_int8_gemv_within_fp32_sums_of_exact(ops, native, n, k, dtype):
    g = torch.Generator().manual_seed(n * k)
    parts, dense = _int8(torch.randn(n, k, generator=g))
    x = torch.randn(9, k, generator=g).to(dtype)
    exact = x.double() @ dense.double().T
    bound = 2 * k * 2**-24 * (x.double().abs() @ dense.double().abs().T) + 1e-6
    lone = torch.stack([ops.int8_gemv(row.contiguous(), *parts, False) for row in x])
    assert lone.dtype == torch.float32 and lone.shape == (9, n)
    assert ((lone.double() - exact).abs() <= bound).all(), (lone.double() - exact).abs().max()
    for m in (2, 8, 9):
        assert torch.equal(ops.int8_gemv(x[:m].contiguous(), *parts, False), lone[:m]), m
    if dtype == torch.bfloat16:
        assert torch.equal(ops.int8_gemv(x[0].contiguous(), *parts, True), lone[0].bfloat16())
    with pytest.raises(RuntimeError, match=r"contiguous Char \(N, \d+\) weight expected"):
        ops.int8_gemv(x[0].contiguous(), parts[0].float(), parts[1], False)
    with pytest.raises(RuntimeError, match="contiguous Float vector"):
        ops.int8_gemv(x[0].contiguous(), parts[0], parts[1].bfloat16(), False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_decode_layer_quantized_against_eager_step(ops, native, dtype, kind):
    """A layer over Q4_1 or int8 weights against the eager step's operations over the dequantized matrices (the
    embedded default's widths), rows each alone bit for bit, and a refused call that writes nothing."""
    hidden, (num_q, num_kv), head_dim, inter, context = 576, (9, 3), 64, 1536, 50
    g = torch.Generator().manual_seed(5)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    shapes = [((num_q + 2 * num_kv) * head_dim, hidden), (hidden, num_q * head_dim), (2 * inter, hidden),
              (hidden, inter)]
    quantize = _q4 if kind == "q4_1" else _int8
    q4, dense = zip(*(quantize(torch.randn(*shape, generator=g) * 0.1) for shape in shapes))
    norms = (1 + rand(hidden, s=0.1), 1 + rand(hidden, s=0.1))
    angle = torch.rand(head_dim // 2, generator=g) * 6
    cos = torch.cat([angle.cos(), angle.cos()]).to(dtype)
    signed_sin = torch.cat([-angle.sin(), angle.sin()]).to(dtype)
    pool = 3 * context + 5
    k_cache, v_cache = rand(pool, num_kv, head_dim), rand(pool, num_kv, head_dim)
    slots = torch.randperm(pool, generator=g)[:context]
    out_slot = int(slots[-1])
    eps, scale = 1e-5, head_dim**-0.5
    x, residual = rand(hidden), rand(hidden)
    kr, vr = k_cache.clone(), v_cache.clone()
    want_x, want_residual = _reference_layer(x, residual, False, (*norms, *(w.to(dtype) for w in dense)), cos,
                                             signed_sin, kr, vr, slots, out_slot, num_q, num_kv, eps, scale)
    kk, vk = k_cache.clone(), v_cache.clone()
    xk, rk = x[None].clone(), residual[None].clone()
    ops.decode_layer_q(xk, rk, False, *norms, *q4, cos[None], signed_sin[None], kk, vk, slots,
                        torch.tensor([0, context]), torch.tensor([out_slot]), num_q, num_kv, eps, scale)
    # bf16: the reference rounds each dequantized weight to bf16, the kernel multiplies by it exactly
    rel = 2**-5 if dtype == torch.bfloat16 else 1e-4
    for got, want in ((kk[out_slot], kr[out_slot]), (vk[out_slot], vr[out_slot]), (rk[0], want_residual),
                      (xk[0], want_x)):
        tol = rel * want.float().abs() + rel * want.float().abs().max()
        assert ((got.float() - want.float()).abs() <= tol).all(), (got - want).abs().max()
    assert F.cosine_similarity(xk[0].double(), want_x.double(), dim=0) > 1 - 1e-3

    # two rows in one call: each one's values are those it gets alone
    x2, r2 = torch.stack([x, rand(hidden)]), torch.stack([residual, rand(hidden)])
    other = torch.randperm(pool, generator=g)[:7]
    kb, vb, xb, rb = k_cache.clone(), v_cache.clone(), x2.clone(), r2.clone()
    ops.decode_layer_q(xb, rb, False, *norms, *q4, torch.stack([cos, cos.flip(0)]),
                        torch.stack([signed_sin, signed_sin.flip(0)]), kb, vb, torch.cat([slots, other]),
                        torch.tensor([0, context, context + 7]), torch.tensor([out_slot, int(other[-1])]),
                        num_q, num_kv, eps, scale)
    assert torch.equal(xb[0], xk[0]) and torch.equal(rb[0], rk[0]) and torch.equal(kb[out_slot], kk[out_slot])

    with pytest.raises(RuntimeError, match="down: a quantized weight is"):
        ops.decode_layer_q(xk, rk, False, *norms, *q4[:3], q4[3][:1], cos[None], signed_sin[None], kk, vk, slots,
                            torch.tensor([0, context]), torch.tensor([out_slot]), num_q, num_kv, eps, scale)
    kc = k_cache.clone()
    with pytest.raises(RuntimeError, match="qkv: 1024 rows expected, got 960"):
        ops.decode_layer_q(xk, rk, False, *norms, *q4, cos[None], signed_sin[None], kc, vk, slots,
                            torch.tensor([0, context]), torch.tensor([out_slot]), num_q + 1, num_kv, eps, scale)
    assert torch.equal(kc, k_cache)


def test_prefill_attention_against_sdpa(ops):
    """A step's causal attention over each sequence's scattered slots (new prompts, prompt chunks after a cached
    prefix, one-token decode rows) against SDPA in float64 with the same mask: its error no larger than bf16 SDPA's
    (both round the weights to bf16 before multiplying the values). Refuses what it cannot take."""
    if not ops.set_native_bf16(True):
        pytest.skip("this CPU has no AVX512-BF16: the kernel is not used here")
    g = torch.Generator().manual_seed(4)
    for (num_q, num_kv, d), seqs in (((9, 3, 64), [(100, 100)]),
                                     ((9, 3, 64), [(37, 5), (300, 300), (1, 1), (700, 250)]),
                                     ((8, 1, 128), [(200, 33), (17, 17)]),
                                     ((4, 4, 64), [(40, 1), (65, 1)])):
        pool = sum(n for n, _ in seqs) + 10
        k_cache = torch.randn(pool, num_kv, d, generator=g).bfloat16()
        v_cache = torch.randn(pool, num_kv, d, generator=g).bfloat16()
        perm, slots, at = torch.randperm(pool, generator=g), [], 0
        for n, _ in seqs:
            slots.append(perm[at:at + n])
            at += n
        rows = sum(m for _, m in seqs)
        q = torch.randn(rows, num_q + 2 * num_kv, d, generator=g).bfloat16()[:, :num_q]  # a view, as the step's
        starts = torch.tensor([0, *torch.tensor([n for n, _ in seqs]).cumsum(0).tolist()])
        out = ops.prefill_attention(q, k_cache, v_cache, torch.cat(slots), starts, torch.tensor([m for _, m in seqs]),
                                    d**-0.5)
        assert out.shape == (rows, num_q, d) and out.dtype == torch.bfloat16
        row = 0
        for (n, m), s in zip(seqs, slots):
            mask = torch.ones(m, n, dtype=torch.bool).tril(n - m)

            def sdpa(dtype):
                return F.scaled_dot_product_attention(
                    q[row:row + m].to(dtype).transpose(0, 1)[None], k_cache[s].to(dtype).transpose(0, 1)[None],
                    v_cache[s].to(dtype).transpose(0, 1)[None], attn_mask=mask, scale=d**-0.5,
                    enable_gqa=True)[0].transpose(0, 1).double()

            want = sdpa(torch.float64)
            ours, theirs = (out[row:row + m].double() - want).abs(), (sdpa(torch.bfloat16) - want).abs()
            assert ours.max() <= 1.25 * theirs.max() + 1e-4 and ours.mean() <= 1.25 * theirs.mean() + 1e-5
            assert (ours <= 2**-6 * want.abs() + 1e-2).all()
            row += m
    with pytest.raises(RuntimeError, match="sequence 0 has 5 queries for 4 keys"):
        ops.prefill_attention(q[:5], k_cache, v_cache, torch.arange(4), torch.tensor([0, 4]), torch.tensor([5]), 0.1)
    with pytest.raises(RuntimeError, match="head size 64 or 128"):
        ops.prefill_attention(torch.zeros(1, 2, 32).bfloat16(), k_cache, v_cache, torch.arange(1),
                              torch.tensor([0, 1]), torch.tensor([1]), 0.1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.prefill_attention(q[:1], k_cache, v_cache, torch.tensor([pool]), torch.tensor([0, 1]), torch.tensor([1]),
                              0.1)
