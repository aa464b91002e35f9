"""DeepSeek-V4's fixed-shape decode metadata from deepinfer_kernels.v4_static_decode (the CUDA graph step's form)
equals StaticDecode's torch form element for element, in Triton's interpreter: pages of 1, 4 and 16 tokens,
windows shorter and longer than a page, a padding row, positions at 0, on window and page edges and at the row's
last token, recent pages held and not."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_STATIC = textwrap.dedent("""
    from types import SimpleNamespace
    import torch
    from deepinfer_rt.models.deepseek_v4.graph_batch import StaticDecode
    g = torch.Generator().manual_seed(0)
    for ps, window, ratios in [(4, 8, (4, 128)), (1, 16, (2,)), (16, 128, (4, 128)), (4, 3, (1, 8))]:
        num_pages, width_pages = 80, 40
        width = width_pages * ps
        table = torch.randint(0, num_pages, (6, width_pages), generator=g, dtype=torch.int32)
        recent = torch.randint(-1, 50, (num_pages,), generator=g)  # -1: the page has no recent copy
        pool = SimpleNamespace(page_size=ps, recent_of_t=recent, pad_recent_slot=9999,
                               entry_divisor=lambda m, ps=ps: min(m, ps), pad_entry_row=lambda m: 7000 + m)
        positions = torch.tensor([0, 5, 127, width - 1, 0, 3, 128, 255, 31]) % width  # a row holds width tokens
        seq_lens = positions + 1
        seq_lens[4] = 0  # a padding row
        rows = torch.randint(0, 6, (9,), generator=g, dtype=torch.int32)
        ids = torch.arange(9)
        step = StaticDecode(ids, positions, seq_lens, table, rows, pool, window, ratios)
        got, want = step.kernel_step(), step.torch_step()
        assert torch.equal(got.positions, want.positions) and torch.equal(got.out_slots, want.out_slots)
        (a,), (b,) = got.groups, want.groups
        for name in ("rows", "swa_slots", "swa_mask"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (ps, name, x, y)
        assert a.covers_all and (a.num_seqs, a.q_len) == (b.num_seqs, b.q_len)
        for m in ratios:
            for x, y in ((a.entry_slots[m], b.entry_slots[m]), (a.entry_mask[m], b.entry_mask[m])):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (ps, m)
            for name in ("cur", "prev", "has_prev", "positions", "end"):
                x, y = getattr(got.windows[m], name), getattr(want.windows[m], name)
                assert x.dtype == y.dtype and torch.equal(x, y), (ps, m, name, x, y)
        assert (want.out_slots == 9999).sum() >= 1  # the padding row (and rows without a recent page)
    print("ok")
""")


def test_static_decode_kernels_equal_torch_form():
    assert _interpret(_STATIC).strip().endswith("ok")
