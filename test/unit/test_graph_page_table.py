"""The CUDA-graph runner's persistent page table (its bookkeeping runs the same on a CPU table): rows hold each
request's pages, only new pages are uploaded, replaced page lists are re-uploaded, finished requests free rows;
page lists of requests leaving prefill are uploaded ahead of their first graph step, into free rows only."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer_rt.cache.page_table import PageTable, pages_per_request
from deepinfer_rt.cuda_graph import CudaGraphRunner
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


def test_one_page_growth_is_left_to_the_caller():
    """rows(reqs, appends): a list grown by one page hands that page to the caller (a graph writes it); longer
    growth, a new request and a replaced list still upload here; the rest point at the scratch cell."""
    table = PageTable(num_rows=3, width=8, device=torch.device("cpu"))
    a, b = _req(0, [5, 9]), _req(1, [7])
    rows = table.rows([a, b])
    a.pages.append(11)  # one page: the caller's
    b.pages.extend([3, 4])  # two: uploaded here
    c = _req(2, [8, 6])  # new: uploaded here
    appends: list[int] = []
    assert table.rows([a, b, c], appends)[:2] == rows
    assert appends[0:2] == [rows[0] * 8 + 2, 11] and appends[2:] == [table.scratch, 0, table.scratch, 0]
    assert _row(table, rows[0], 3) == [5, 9, 0] and _row(table, rows[1], 3) == [7, 3, 4]
    table.cells[appends[0::2]] = torch.tensor(appends[1::2], dtype=torch.int32)  # what the graph does
    assert _row(table, rows[0], 3) == [5, 9, 11]
    appends.clear()
    table.rows([a], appends)  # nothing new: scratch
    assert appends == [table.scratch, 0]


def test_finished_requests_give_their_rows_back():
    table = PageTable(num_rows=2, width=4, device=torch.device("cpu"))
    a, b, c = _req(0, [1]), _req(1, [2]), _req(2, [3])
    table.rows([a, b])
    assert table.rows([c]) is None  # no free row while both run
    a.finish("stop")
    rows = table.rows([c])
    assert rows is not None and _row(table, rows[0], 1) == [3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["grow", "replace"]),
                                   st.integers(1, 40)), min_size=1, max_size=6), min_size=1, max_size=8))
def test_rows_hold_every_page_list_after_any_growth(steps):
    """Each step: some requests grow their page list (many pages at once, as a first graph step after a long
    prefill) or get a new one; after rows() every request's row spells its whole list."""
    table = PageTable(num_rows=12, width=256, device=torch.device("cpu"))
    reqs = [_req(i, []) for i in range(6)]
    next_page = iter(range(10**6))
    for step in steps:
        for rid, kind, n in step:
            new = [next(next_page) for _ in range(n)]
            if kind == "grow" and len(reqs[rid].pages) + n <= 256:
                reqs[rid].pages.extend(new)
            else:
                reqs[rid].pages = new
        live = [r for r in reqs if r.pages]
        rows = table.rows(live)
        for r, row in zip(live, rows):
            assert _row(table, row, len(r.pages)) == r.pages


class _StagingEvent:
    """CPU stand-in for the runner's staging event: `done` says whether the last upload was read."""

    def __init__(self):
        self.done = True

    def query(self) -> bool:
        return self.done

    def record(self) -> None:
        pass


def _runner(num_rows: int, width: int) -> CudaGraphRunner:
    runner = object.__new__(CudaGraphRunner)  # the bookkeeping only: no model, no captured graphs
    runner.pages = PageTable(num_rows, width, torch.device("cpu"))
    runner._graphs = {1: None}
    runner._staged = _StagingEvent()
    runner.page_size, runner.max_context = 1, width
    return runner


def test_prefetch_uploads_whole_lists_into_free_rows_only():
    runner = _runner(num_rows=2, width=8)
    a, b, c = _req(0, [5, 6, 7]), _req(1, [8]), _req(2, [9, 10])
    runner.prefetch_pages([a, b, c])  # more new requests than free rows: nothing taken
    assert not any(runner.pages.has_row(r) for r in (a, b, c))
    runner._staged.done = False  # the last upload may still be read from the staging buffer: skip, never wait
    runner.prefetch_pages([a])
    assert not runner.pages.has_row(a)
    runner._staged.done = True
    runner.prefetch_pages([a, b])
    (row_a,) = runner.pages.rows([a])
    assert _row(runner.pages, row_a, 3) == [5, 6, 7]
    a.pages.append(11)  # the first graph step uploads only what came after the prefetch
    runner.pages.table[row_a, 0] = -1
    assert runner.pages.rows([a, b]) is not None
    assert _row(runner.pages, row_a, 4) == [-1, 6, 7, 11]


def test_page_lists_longer_than_a_row_are_refused_never_cut():
    """Rows are as wide as the pool lets one request grow, so a longer list is a bookkeeping error: refused
    loudly (a cut row would make a step attend to part of its context), and the neighbouring row is intact."""
    table = PageTable(num_rows=2, width=4, device=torch.device("cpu"))
    a, b = _req(0, [1, 2, 3, 4]), _req(1, [7, 8])
    row_a, row_b = table.rows([a, b])
    a.pages.append(5)
    with pytest.raises(ValueError, match="past the page table"):
        table.rows([a, b])
    assert _row(table, row_b, 2) == [7, 8] and _row(table, row_a, 4) == [1, 2, 3, 4]


def test_rows_cover_every_context_the_pool_holds():
    """The width is the most pages one request can hold: its context limit, or every page of the pool."""
    assert pages_per_request(max_context=163840, num_pages=40000, page_size=1) == 40000
    assert pages_per_request(max_context=4096, num_pages=40000, page_size=16) == 256
    assert pages_per_request(max_context=4097, num_pages=40000, page_size=16) == 257


def test_a_list_cut_and_regrown_to_the_same_length_is_uploaded_again():
    """Drafts rolled back (the list cut in place) and regrown with other pages: same object, same length."""
    table = PageTable(num_rows=1, width=8, device=torch.device("cpu"))
    a = _req(0, [1, 2, 3])
    (row,) = table.rows([a])
    del a.pages[1:]
    a.pages.extend([8, 9])
    table.rows([a])
    assert _row(table, row, 3) == [1, 8, 9]


def test_a_cut_list_uploads_only_from_the_cut_on():
    """Speculation gives rejected drafts' pages back (Req.cut_pages) and regrows the list, possibly with the
    very page it gave back at the old last position: the head is kept, everything from the cut is uploaded."""
    table = PageTable(num_rows=1, width=16, device=torch.device("cpu"))
    a = _req(0, [1, 2, 3, 4, 5])
    (row,) = table.rows([a])
    assert a.cut_pages(2) == [3, 4, 5]
    a.pages.extend([7, 8, 5])  # same length, same last page as uploaded, other pages in between
    table.table[row, 0] = -1  # a re-uploaded head would overwrite this
    before = table.num_uploaded_pages
    table.rows([a])
    assert _row(table, row, 5) == [-1, 2, 7, 8, 5]
    assert table.num_uploaded_pages - before == 3
    a.cut_pages(4)  # cut, then read before regrowing: nothing to upload; the next growth uploads only itself
    table.rows([a])
    a.pages.append(9)
    before = table.num_uploaded_pages
    table.rows([a])
    assert _row(table, row, 5) == [-1, 2, 7, 8, 9] and table.num_uploaded_pages - before == 1
    a.cut_pages(3)
    a.pages.append(4)
    a.cut_pages(1)  # two cuts between reads: the lower one is unknown to the table, so it uploads the list
    a.pages.extend([6, 8])
    table.rows([a])
    assert _row(table, row, 3) == [1, 6, 8]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["grow", "cut", "replace"]),
                          st.lists(st.integers(0, 3), max_size=4), st.booleans()), min_size=1, max_size=20))
@example([(0, "grow", [0, 1, 2], True), (0, "cut", [0, 0], False), (0, "grow", [3, 2], True)])
def test_rows_hold_every_page_list_after_cuts_and_regrowth(ops):
    """Grows, in-place cuts and replacements, with page ids from a small range so that a regrown list often
    reuses the pages it gave back; after any rows() call every request's row spells its whole list."""
    table = PageTable(num_rows=4, width=128, device=torch.device("cpu"))
    reqs = [_req(i, []) for i in range(4)]
    for rid, kind, pages, read in ops:
        req = reqs[rid]
        if kind == "grow":
            req.pages.extend(pages)
        elif kind == "cut":
            req.cut_pages(max(len(req.pages) - len(pages), 0))
        else:
            req.pages = list(pages)
        if read:
            live = [r for r in reqs if r.pages]
            for r, row in zip(live, table.rows(live)):
                assert _row(table, row, len(r.pages)) == r.pages
