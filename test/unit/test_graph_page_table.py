"""The CUDA-graph runner's persistent page table (its bookkeeping runs the same on a CPU table): rows hold each
request's pages, only new pages are uploaded, replaced page lists are re-uploaded, finished requests free rows."""
from __future__ import annotations

import torch

from deepinfer_rt.cuda_graph import PageTable
from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams


def _req(rid: int, pages: list[int]) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(), seed=0)
    req.pages = pages
    return req


def _row(table: PageTable, row: int, n: int) -> list[int]:
    return table.table[row, :n].tolist()


def test_rows_track_page_lists_incrementally():
    table = PageTable(num_rows=2, width=8, device=torch.device("cpu"))
    a, b = _req(0, [5, 9]), _req(1, [7])
    rows = table.rows([a, b])
    assert _row(table, rows[0], 2) == [5, 9] and _row(table, rows[1], 1) == [7]
    a.pages.extend([11, 12])  # decode grows the same list: only the tail is uploaded
    table.table[rows[0], 0] = -1  # a stale entry would survive, proving the head was not re-uploaded
    assert table.rows([a]) == rows[:1]
    assert _row(table, rows[0], 4) == [-1, 9, 11, 12]
    a.pages = [3, 4]  # retracted and re-admitted: a new list is uploaded whole
    table.rows([a])
    assert _row(table, rows[0], 2) == [3, 4]


def test_finished_requests_give_their_rows_back():
    table = PageTable(num_rows=2, width=4, device=torch.device("cpu"))
    a, b, c = _req(0, [1]), _req(1, [2]), _req(2, [3])
    table.rows([a, b])
    assert table.rows([c]) is None  # no free row while both run
    a.finish("stop")
    rows = table.rows([c])
    assert rows is not None and _row(table, rows[0], 1) == [3]
