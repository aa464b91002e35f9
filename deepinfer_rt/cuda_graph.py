"""CUDA graphs for decode steps.

A decode step (every item computes one token) launches hundreds of small kernels; replaying a captured graph
removes their launch cost. Graphs are captured once per batch size in `batch_sizes`; a batch runs in the
smallest graph that holds it, padding rows reading no KV (seq_len 0) and storing none (slot -1).

Host work per step is kept proportional to the batch, not to its context: each running request owns a row of
a persistent device page table, and only pages added since the last step are uploaded (a request whose page
list was replaced -- retracted, re-admitted -- is uploaded again). A request's whole list goes up from the
eager step that ends its prefill, behind that step's GPU work (`prefetch_pages`), not in its first graph step,
where the GPU would wait for it. The per-row inputs (token, position, store slot, table row, KV length) go up
in one pinned, non-blocking copy, so preparing a step never waits on the GPU.

In batch-invariant mode the graphs are captured with the invariant layers and the backend's fixed-split
attention (its split count covers `max_context`), so a replayed step is bitwise an eager one. A model whose
decode step reads values back to the host in that mode (the torch expert loop of MoE layers) cannot be
captured; such a runner captures nothing and every step runs eagerly.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.forward_batch import ForwardBatch, resolve_placeholders
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.request import Req
from deepinfer_rt.scheduler.batch import ScheduledBatch

if TYPE_CHECKING:  # the Triton backend imports triton, which CPU installs may lack
    from deepinfer_rt.layers.attention.triton import TritonBackend

logger = logging.getLogger("deepinfer_rt")
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
_TOKEN, _POS, _SLOT, _ROW, _LEN = range(5)


@dataclass
class _Entry:
    req: Req
    row: int
    pages: list[int]
    """The request's page list object when uploaded (identity tells a replaced list from an extended one)."""
    uploaded: int


class PageTable:
    """Persistent device page table: one row per running request, updated incrementally."""

    def __init__(self, num_rows: int, width: int, device: torch.device):
        self.table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
        self.width = width
        self._free = list(range(num_rows - 1, -1, -1))
        self._entries: dict[int, _Entry] = {}
        self._pin = self.table.is_cuda  # pinned staging makes the upload asynchronous; CPU tables copy directly
        self._staging = torch.empty(2 * 65536, dtype=torch.int64, pin_memory=self._pin)

    def _release_idle(self, keep: set[int]) -> None:
        for rid, e in list(self._entries.items()):
            if rid not in keep and (e.req.is_finished or e.req.pages is not e.pages):
                self._free.append(e.row)
                del self._entries[rid]

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def has_row(self, req: Req) -> bool:
        return req.rid in self._entries

    def rows(self, reqs: list[Req]) -> list[int] | None:
        """Table row of each request after uploading its new pages; None if rows ran out."""
        missing = sum(1 for r in reqs if r.rid not in self._entries)
        if missing > len(self._free):
            self._release_idle({r.rid for r in reqs})
            if missing > len(self._free):
                return None
        rows, starts, runs = [], [], []
        for r in reqs:
            e = self._entries.get(r.rid)
            if e is None:
                e = self._entries[r.rid] = _Entry(r, self._free.pop(), r.pages, 0)
            elif e.pages is not r.pages or len(r.pages) < e.uploaded:
                e.pages, e.uploaded = r.pages, 0
            n = min(len(r.pages), self.width)  # pages past the row (allocated ahead) are never read by a graph
            if n > e.uploaded:
                starts.append(e.row * self.width + e.uploaded)
                runs.append(r.pages[e.uploaded:n])
                e.uploaded = n
            rows.append(e.row)
        if runs:
            self._upload(starts, runs)
        return rows

    def _upload(self, starts: list[int], runs: list[list[int]]) -> None:
        """Write each run of pages from its flat table index on, in one copy. Whole page lists are long (a
        2K-token prompt: 2K pages at page_size 1), so index and values are built by numpy: torch.tensor of
        the Python lists took ~0.13 s for a batch of 256 such requests, with the GPU waiting."""
        lengths = np.fromiter(map(len, runs), dtype=np.int64, count=len(runs))
        n = int(lengths.sum())
        if self._staging.numel() < 2 * n:
            self._staging = torch.empty(4 * n, dtype=torch.int64, pin_memory=self._pin)
        stage = self._staging[: 2 * n].view(2, n)
        # Entry j of the flat order, in run i, goes to starts[i] + j - (entries before run i).
        shift = np.asarray(starts, dtype=np.int64) - (lengths.cumsum() - lengths)
        stage[0] = torch.from_numpy(np.repeat(shift, lengths) + np.arange(n))
        stage[1] = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(runs), dtype=np.int64, count=n))
        dev = stage.to(self.table.device, non_blocking=True)
        self.table.view(-1).index_copy_(0, dev[0], dev[1].to(torch.int32))


class CudaGraphRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: "TritonBackend", max_batch_size: int,
                 max_context: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.page_size = pool.page_size
        self.max_context = max_context
        dev = pool.k[0].device
        self.batch_sizes = sorted({b for b in batch_sizes if b < max_batch_size} | {max_batch_size})
        self.max_bs = self.batch_sizes[-1]
        width = -(-max_context // self.page_size)
        self.pages = PageTable(self.max_bs * 2, width, dev)
        self._io = torch.zeros(5, self.max_bs, dtype=torch.int64, device=dev)
        self._stage = torch.zeros(5, self.max_bs, dtype=torch.int64).pin_memory()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._staged = torch.cuda.Event()
        """Recorded after the uploads from the pinned staging buffers (page table and per-row inputs)."""
        self._capture_all()

    def _padding(self, start: int) -> None:
        self._stage[:, start:] = 0
        self._stage[_SLOT, start:] = -1

    def _forward_batch(self, bs: int) -> ForwardBatch:
        from deepinfer_rt.layers.attention.triton import TritonMeta

        io = self._io[:, :bs]
        fb = ForwardBatch(input_ids=io[_TOKEN], positions=io[_POS], out_slots=io[_SLOT], q_lens=[1] * bs,
                          kv_lens=[1] * bs, kv_slots=[], pool=self.pool, backend=self.backend)
        decode = self.backend.decode_meta(self.pages.table, io[_ROW], io[_LEN], self.page_size,
                                          *self.pool.k[0].shape[1:])
        fb.attn_meta = TritonMeta(decode, None)
        self.model.prepare_batch(fb)
        return fb

    @torch.no_grad()
    def _capture_all(self) -> None:
        self._padding(0)
        # Distinct tokens for the warm-up runs: kernels autotuned on their first call (the fused MoE) then see
        # tokens routed to many experts, as in real decode steps, not every token on the same few.
        vocab = self.model.config.vocab_size
        self._stage[_TOKEN] = torch.randint(0, vocab, (self.max_bs,), generator=torch.Generator().manual_seed(0))
        self._io.copy_(self._stage)
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its memory
                fb = self._forward_batch(bs)
                self.model(fb)  # compiles the kernels and fills lazy tables outside the capture
                if not self._graphs and self._syncs_host(fb):
                    break
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream):
                    self._outputs[bs] = self.model(fb)
                self._graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)

    def _syncs_host(self, fb: ForwardBatch) -> bool:
        """Whether a warm decode step waits on the GPU (reads a value back), which a capture cannot hold."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.model(fb)
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            logger.warning("decode steps of this model synchronize with the host; CUDA graphs are off (%s)", e)
            return True
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return False

    def can_run(self, batch: ScheduledBatch) -> bool:
        items = batch.items
        return (bool(self._graphs) and 0 < len(items) <= self.max_bs and all(it.num_new_tokens == 1 for it in items)
                and max(it.start for it in items) < self.max_context)

    def prefetch_pages(self, reqs: list[Req]) -> None:
        """Give rows to requests whose prefill ends in the step being computed and upload their page lists now,
        from the eager step once its forward is launched, where this host work overlaps the GPU's: their first
        graph step then uploads one page each instead of the prompt's pages, with the GPU waiting. Takes only
        free rows, and skips (never waits) while the staging buffer may still be read."""
        # A prompt past the graphs' context never decodes in one: no row for it.
        new = [r for r in reqs if not self.pages.has_row(r) and len(r.pages) * self.page_size < self.max_context]
        if not self._graphs or not new or len(new) > self.pages.num_free_rows or not self._staged.query():
            return
        self.pages.rows(new)
        self._staged.record()

    def run(self, batch: ScheduledBatch, input_ids: list[int] | None = None,
            future: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states (n, hidden) of a decode batch, or None when it does not fit a graph. `input_ids`: each
        row's token when some are placeholders (-1 - k) for the previous step's tokens `future`, still on the
        device (overlap scheduling, model_runner); by default the requests' tokens at their positions."""
        if not self.can_run(batch):
            return None
        # Under overlap scheduling the previous step's upload may still be queued behind the GPU's work:
        # the pinned staging buffers are rewritten only once it has been read.
        self._staged.synchronize()
        reqs = [it.req for it in batch.items]
        rows = self.pages.rows(reqs)
        if rows is None:
            return None
        n = len(reqs)
        bs = next(b for b in self.batch_sizes if b >= n)
        ps = self.page_size
        positions = [it.start for it in batch.items]
        self._stage[_TOKEN, :n] = torch.tensor(input_ids if input_ids is not None
                                               else [r.token_ids[p] for r, p in zip(reqs, positions)])
        self._stage[_POS, :n] = torch.tensor(positions)
        self._stage[_SLOT, :n] = torch.tensor([r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, positions)])
        self._stage[_ROW, :n] = torch.tensor(rows)
        self._stage[_LEN, :n] = self._stage[_POS, :n] + 1
        self._padding(n)
        self._io.copy_(self._stage, non_blocking=True)  # whole buffer: a strided copy would stage through pageable memory
        self._staged.record()
        if future is not None:
            self._io[_TOKEN, :n] = resolve_placeholders(self._io[_TOKEN, :n], future)
        self._graphs[bs].replay()
        return self._outputs[bs][:n]
