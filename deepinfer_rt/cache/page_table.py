"""Device page table: one row per running request, holding its page list, kept up to date incrementally.

A decode step grows a request by at most a page, so rebuilding its page (or slot) list on the host every step
would cost O(context) per request per step: a 32K-token request at page size 1 is 32K entries to build and
upload for one new token. Instead each request owns a row of this persistent table and only the pages added
since its last step are uploaded (append-only); a request whose page list was replaced (retracted and
re-admitted) is uploaded again whole, once. A list cut in place (speculation gives the pages of rejected drafts
back, `Req.cut_pages`) and regrown keeps its head: only pages from the cut on are uploaded again.

The width is sized by the pool, never by a fixed context: a row holds `pages_per_request` pages, the most one
request can hold (its context limit, or every page of the pool), so every context the pool can hold is
covered and a row is never cut. CUDA graphs (deepinfer_rt.cuda_graph) and eager steps (model_runner) read the
same table.

Row invariant, after `rows(reqs)`: table[row, : len(req.pages)] == req.pages for every req given -- or, where the
caller takes the one-page appends itself (`rows(reqs, appends)`: a CUDA-graph step writes them inside its graph,
cuda_graph.py), once the caller has written each (flat index, page) pair into `cells`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_rt.request import Req


def pages_per_request(max_context: int, num_pages: int, page_size: int) -> int:
    """Most pages one request can hold: its longest context, bounded by the pool."""
    return max(1, min(-(-max_context // page_size), num_pages))


@dataclass
class _Entry:
    req: Req
    row: int
    pages: list[int]
    """The request's page list object when uploaded (identity tells a replaced list from an extended one)."""
    uploaded: int
    last_page: int
    """pages[uploaded - 1] when uploaded (-1 if none): a list cut and regrown to the same length outside
    `Req.cut_pages` differs here (a safety net; every cut in place goes through it)."""
    num_cuts: int
    """req.num_page_cuts when uploaded."""


@dataclass
class DevicePages:
    """What a step's attention reads of the table: each sequence's row, and the pool's page size."""
    table: torch.Tensor
    """(R, W) int32 page ids."""
    rows: torch.Tensor
    """(B,) int32 table row of each sequence of the batch."""
    page_size: int

    def slots(self, row: int, num_tokens: int) -> torch.Tensor:
        """Slot of each of the first `num_tokens` positions of the request in `row`, on the table's device:
        no host list of the context."""
        ps = self.page_size
        if ps == 1:
            return self.table[row, :num_tokens].long()
        pages = self.table[row, : -(-num_tokens // ps)].long()
        return (pages[:, None] * ps + torch.arange(ps, device=pages.device)).view(-1)[:num_tokens]


class PageTable:
    """Persistent device page table, updated incrementally (see the module docstring)."""

    def __init__(self, num_rows: int, width: int, device: torch.device):
        # zeros: on the host a large table is mapped lazily, so unused capacity costs no memory there.
        self.cells = torch.zeros(num_rows * width + 1, dtype=torch.int32, device=device)
        """The table's cells, flat, and one scratch cell after them (`scratch`): a writer of fixed shape (a graph's
        page appends) sends the rows that append nothing there."""
        self.table = self.cells[:-1].view(num_rows, width)
        self.scratch = num_rows * width
        self.width = width
        self._free = list(range(num_rows - 1, -1, -1))
        self._entries: dict[int, _Entry] = {}
        self._pin = self.table.is_cuda  # pinned staging makes the upload asynchronous; CPU tables copy directly
        self._staging = torch.empty(2 * 65536, dtype=torch.int64, pin_memory=self._pin)
        self._read = torch.cuda.Event() if self._pin else None
        """Recorded after each upload: the staging buffer is rewritten only once the copy has read it."""
        self.num_uploaded_pages = 0
        """Pages written into the table so far (a counter the host-work tests read)."""

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def has_row(self, req: Req) -> bool:
        return req.rid in self._entries

    def _release_idle(self, keep: set[int]) -> None:
        for rid, e in list(self._entries.items()):
            if rid not in keep and (e.req.is_finished or e.req.pages is not e.pages):
                self._free.append(e.row)
                del self._entries[rid]

    def rows(self, reqs: list[Req], appends: list[int] | None = None) -> list[int] | None:
        """Table row of each request after uploading its new pages; None if rows ran out. A page list longer
        than a row is refused: the width covers the pool, so that is a bookkeeping bug, never a cut.

        `appends`: a list the caller writes itself, extended by two ints per request, a flat cell index and a
        page -- the request's one new page when it grew by exactly one since its last upload (a decode step's
        usual case), else `scratch` and 0 -- instead of uploading those pages here: the caller must write them
        before the step reads the table (as a graph does at its start)."""
        missing = sum(1 for r in reqs if r.rid not in self._entries)
        if missing > len(self._free):
            self._release_idle({r.rid for r in reqs})
            if missing > len(self._free):
                return None
        rows, starts, runs = [], [], []
        for r in reqs:
            pages = r.pages
            n = len(pages)
            if n > self.width:
                raise ValueError(f"request {r.rid} holds {n} pages, past the page table's {self.width} per row")
            e = self._entries.get(r.rid)
            if e is None:
                e = self._entries[r.rid] = _Entry(r, self._free.pop(), pages, 0, -1, r.num_page_cuts)
            elif e.pages is not pages:
                e.pages, e.uploaded, e.num_cuts = pages, 0, r.num_page_cuts
            elif e.num_cuts != r.num_page_cuts:
                # Cut once since the upload: the head before the cut still holds. More than once: the lowest
                # cut is unknown, upload it all.
                e.uploaded = min(e.uploaded, r.num_pages_at_last_cut) if r.num_page_cuts == e.num_cuts + 1 else 0
                e.num_cuts, e.last_page = r.num_page_cuts, pages[e.uploaded - 1] if e.uploaded else -1
            if n < e.uploaded or (e.uploaded and pages[e.uploaded - 1] != e.last_page):
                e.uploaded = 0
            if appends is not None:
                if n == e.uploaded + 1:
                    appends += (e.row * self.width + e.uploaded, pages[-1])
                    e.uploaded, e.last_page = n, pages[-1]
                else:
                    appends += (self.scratch, 0)
            if n > e.uploaded:
                starts.append(e.row * self.width + e.uploaded)
                runs.append(pages[e.uploaded:])
                e.uploaded, e.last_page = n, pages[-1]
            rows.append(e.row)
        if runs:
            self._upload(starts, runs)
        return rows

    def _upload(self, starts: list[int], runs: list[list[int]]) -> None:
        """Write each run of pages from its flat table index on, in one copy. Index and values are built by
        numpy: torch.tensor of the Python lists of a batch of fresh long prompts took ~0.13 s for 256 of 2K
        pages, with the GPU waiting."""
        lengths = np.fromiter(map(len, runs), dtype=np.int64, count=len(runs))
        n = int(lengths.sum())
        self.num_uploaded_pages += n
        if self._read is not None:
            self._read.synchronize()  # under overlap the last upload may still be queued behind GPU work
        if self._staging.numel() < 2 * n:
            self._staging = torch.empty(4 * n, dtype=torch.int64, pin_memory=self._pin)
        stage = self._staging[: 2 * n].view(2, n)
        # Entry j of the flat order, in run i, goes to starts[i] + j - (entries before run i).
        shift = np.asarray(starts, dtype=np.int64) - (lengths.cumsum() - lengths)
        stage[0] = torch.from_numpy(np.repeat(shift, lengths) + np.arange(n))
        stage[1] = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(runs), dtype=np.int64, count=n))
        dev = stage.to(self.table.device, non_blocking=True)
        if self._read is not None:
            self._read.record()
        self.table.view(-1).index_copy_(0, dev[0], dev[1].to(torch.int32))
