"""The one-kernel Gumbel-max draw (deepinfer_kernels.sampling) in Triton's interpreter: its tokens equal torch's
argmax over the noise it documents, a row's draw does not depend on its batch, and its noise is uniform (so the draws follow softmax(z))."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_DRAWS = textwrap.dedent("""
    import torch
    from deepinfer_kernels import sampling
    from deepinfer_kernels.sampling import gumbel_argmax, gumbel_noise, new_keys
    from deepinfer_rt.sampler import stream_seed
    g = torch.Generator().manual_seed(0)
    vocab = 2500  # three programs a row, the last one partial
    z = torch.randn(6, vocab, generator=g) * 4
    z[2] = float("-inf")  # a row of -inf: token 0, as torch.argmax
    z[3, 100:] = float("-inf")  # top-k-style filtering
    z[4, 7] = z[4, 900] = float("inf")  # a tie: the lower index, as torch.argmax
    seeds = torch.tensor([stream_seed(s, p) for s, p in [(1, 0), (1, 1), (2, 0), (3, 5), (4, 0), (1, 0)]])
    tokens = gumbel_argmax(z, seeds)
    noise = gumbel_noise(seeds, vocab)
    assert noise.min() >= 1e-20 and noise.max() < 1 and torch.equal(noise[0], noise[5])
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(tokens, (z - torch.log(-torch.log(noise))).argmax(-1)), tokens
    assert tokens[2] == 0 and tokens[3] < 100 and tokens[4] == 7
    # Temperatures in the kernel: the draw over torch's z / t (the same IEEE division); t == 0 the plain argmax.
    temps = torch.tensor([0.7, 0.0, 1.3, 2.0, 0.0, 1e-3])
    out = torch.full((6,), -5, dtype=torch.int64)
    scaled = gumbel_argmax(z, seeds, temps, out=out)
    assert scaled.data_ptr() == out.data_ptr()
    want = gumbel_argmax(z / torch.where(temps == 0, 1.0, temps)[:, None], seeds)
    want[temps == 0] = z[temps == 0].argmax(-1)
    assert torch.equal(scaled, want), (scaled, want)
    staged = torch.from_numpy(temps.numpy().view("int32").astype("int64"))  # as a decode graph stages them
    assert torch.equal(gumbel_argmax(z, seeds, staged.view(torch.float32)[0::2]), want)  # a strided view
    keys = new_keys(8, z.device)  # a kept state (a CUDA graph's): left as found after each draw
    for _ in range(2):
        assert torch.equal(gumbel_argmax(z, seeds, temps, keys=keys), want)
        assert torch.equal(keys, new_keys(8, z.device))
    assert torch.equal(sampling._states[z.device], new_keys(256, z.device))  # the device's kept state too
    try:
        gumbel_argmax(z, seeds, keys=new_keys(5, z.device))
        raise AssertionError("a state of too few rows accepted")
    except ValueError as e:
        assert "at least 6 rows" in str(e)
    # A row's draw alone, in another batch, and in a strided view: the same token.
    for i in range(6):
        assert gumbel_argmax(z[i : i + 1].clone(), seeds[i : i + 1]).item() == tokens[i]
    perm = torch.tensor([5, 3, 0, 1, 4, 2])
    assert torch.equal(gumbel_argmax(z[perm], seeds[perm]), tokens[perm])
    wide = torch.full((6, vocab + 3), -5.0)
    wide[:, :vocab] = z
    assert torch.equal(gumbel_argmax(wide[:, :vocab], seeds), tokens)
    assert gumbel_argmax(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64)).shape == (0,)
    try:
        gumbel_argmax(z, seeds.int())
        raise AssertionError("int32 seeds accepted")
    except ValueError as e:
        assert "int64" in str(e)
    # The noise is uniform (Kolmogorov-Smirnov at p = 0.001, fixed seeds, so no flake) in each of Philox's four
    # lanes; with the exact argmax above, the draws then follow softmax(z) (the Gumbel-max property).
    wide = gumbel_noise(torch.tensor([stream_seed(9, 0), stream_seed(9, 1)]), 32768).double()
    for lane in [wide[:, j::4].flatten() for j in range(4)] + [wide.flatten()]:
        x = lane.sort().values
        n = x.numel()
        grid = torch.arange(1, n + 1, dtype=torch.float64) / n
        ks = max(float((grid - x).max()), float((x - (grid - 1 / n)).max()))
        assert ks < 1.95 / n**0.5, (ks, n)
    print("ok")
""")


def test_gumbel_argmax_equals_torch_over_its_noise_and_follows_softmax():
    assert _interpret(_DRAWS).strip().endswith("ok")
