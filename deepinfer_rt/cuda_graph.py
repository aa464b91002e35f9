"""CUDA graphs for decode steps.

A decode step (every item computes one token) launches hundreds of small kernels; replaying a captured graph
removes their launch cost. Graphs are captured once per batch size in `batch_sizes`; a batch runs in the
smallest graph that holds it, padding rows reading no KV (seq_len 0) and storing none (slot -1).

Host work per step is kept proportional to the batch, not to its context: each running request owns a row of
a persistent device page table (deepinfer_rt.cache.page_table), as wide as the pool lets one request grow, so
a graph decodes every context the pool can hold; only pages added since the last step are uploaded (a request
whose page list was replaced -- retracted, re-admitted -- is uploaded again). A request's whole list goes up from the
eager step that ends its prefill, behind that step's GPU work (`prefetch_pages`), not in its first graph step,
where the GPU would wait for it. The per-row inputs (token, position, store slot, table row, KV length) go up
in one pinned, non-blocking copy, so preparing a step never waits on the GPU.

The step around the forward is in the graph too, so that a decode step launches nothing but its replay: the
placeholder ids of overlap scheduling (-1 - k, the previous step's token of row k, model_runner) are resolved at
the graph's start from `next_tokens`, where the previous step's tokens are; a request's one new page (a decode
step's usual growth) is written into its page table row there too (`PageTable.rows(reqs, appends)`); and with a
`head` (the model's compute_logits) the graph ends with the logits and each row's token, written to
`next_tokens`: each row's draw at the temperature and stream seed staged with its inputs, the argmax for greedy
rows (on CUDA deepinfer_kernels.sampling; uncaptured on a CPU pool, the sampler's CPU noise row by row). These are
the sampler's tokens for rows that nothing else modifies (`Sampler.takes_graph_tokens`). Other steps sample the
graph's logits on the host's side as before.

In batch-invariant mode the graphs are captured with the invariant layers and the backend's fixed-split
attention (its split count covers the page table's width), so a replayed step is bitwise an eager one. A model whose
decode step reads values back to the host in that mode (the torch expert loop of MoE layers) cannot be
captured; such a runner captures nothing and every step runs eagerly.

A model whose decode metadata depends on the inputs' values (DeepSeek-V4's window and entry indices) builds it over
these static tensors in `prepare_graph_batch` and computes it inside its forward, which is what a graph records;
the host's part of such a step (V4's recent-page bookkeeping) runs in `prepare_graph_step` before the replay.
With `is_captured=False` the runner runs the same fixed-shape steps without capturing them (and on a CPU pool):
the graph path's numerics and host work, checked against the eager steps where there is no GPU.

Under expert parallelism (EP > 1) every rank's graphs hold the MoE layers' all-to-alls (NCCL inside the graph):
each rank captures the same batch sizes in the same order inside `capture_scope` (the EP worker's capture-safe
exchange, sized by the graph), and replays the size the worker sets for the step (`step_batch_size`), the same on
every rank.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager

import numpy as np
import torch

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.cache.page_table import DevicePages, PageTable, pages_per_request
from deepinfer_rt.forward_batch import ForwardBatch, resolve_placeholders
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.request import Req
from deepinfer_rt.sampler import draw_streams, stream_seeds
from deepinfer_rt.scheduler.batch import ScheduledBatch

if TYPE_CHECKING:  # the Triton backend imports triton, which CPU installs may lack
    from deepinfer_rt.layers.attention.triton import TritonBackend

logger = logging.getLogger("deepinfer_rt")
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
_TOKEN, _POS, _SLOT, _ROW, _LEN, _CELL, _PAGE, _SEED, _TEMP = range(9)
"""Rows of the staged inputs: token (or placeholder), position, store slot, page table row, KV length, the flat
page table cell of the row's new page (the table's scratch cell when none) with that page, and the draw's stream
seed and temperature (float32 bits; 0 for greedy rows)."""


class CudaGraphRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: "TritonBackend | None", max_batch_size: int,
                 max_context: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, num_rows: int | None = None,
                 is_captured: bool = True,
                 capture_scope: Callable[[int, torch.Tensor], ContextManager] | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None, vocab_size: int = 0):
        self.model = model
        self.head = head
        """hidden rows -> fp32 logits (the model's compute_logits), captured after the forward with each row's token
        drawn over the first `vocab_size` columns at its staged temperature (greedy rows: the argmax); None: graphs
        end at the hidden rows."""
        self.vocab_size = vocab_size
        self.capture_scope = capture_scope or (lambda bs, lengths: nullcontext())
        """Entered around each graph's forwards at capture (uncaptured: each run) with (its batch size, its
        static KV lengths (bs,), 0 on padding rows)."""
        self.step_batch_size: int | None = None
        """Set before each step by an EP worker: the graph every rank replays this step, 0 for none; None: the
        smallest graph that holds the batch."""
        self.is_captured = is_captured
        """False: the fixed-shape steps run as they are, uncaptured (see the module docstring)."""
        self.pool = pool
        self.backend = backend
        self.page_size = pool.page_size
        self.max_context = max_context
        dev = pool.k[0].device
        self.batch_sizes = sorted({b for b in batch_sizes if b < max_batch_size} | {max_batch_size})
        self.max_bs = self.batch_sizes[-1]
        # Rows as wide as the pool allows one request: graphs decode every context the pool can hold.
        width = pages_per_request(max_context, pool.num_slots // self.page_size, self.page_size)
        self.pages = PageTable(num_rows or self.max_bs * 2, width, dev)
        """Shared with the eager steps (model_runner), which keep the same rows up to date."""
        self._io = torch.zeros(9, self.max_bs, dtype=torch.int64, device=dev)
        self._stage = torch.zeros(9, self.max_bs, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._stage_np = self._stage.numpy()
        self.next_tokens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        """The last step's sampled token of each row: placeholders are resolved from it at a graph's start, and a
        graph with a head writes its rows' tokens here at its end."""
        self._keys = None
        if head is not None and dev.type == "cuda":
            from deepinfer_kernels.sampling import new_keys

            self._keys = new_keys(self.max_bs, dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph | ForwardBatch] = {}
        """Batch size -> its graph (uncaptured: its static ForwardBatch)."""
        self._outputs: dict[int, torch.Tensor] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.last_size: int | None = None
        """Batch size of the graph the last `run` replayed."""
        self.num_replays = 0
        self._staged = torch.cuda.Event() if dev.type == "cuda" else _HostEvent()
        """Recorded after the uploads from the pinned staging buffers (page table and per-row inputs)."""
        self._capture_all()

    def _padding(self, start: int) -> None:
        st = self._stage_np
        st[:, start:] = 0
        st[_SLOT, start:] = -1
        st[_CELL, start:] = self.pages.scratch

    def _body(self, bs: int, fb: ForwardBatch) -> None:
        """What a graph of batch size bs runs (captured, or as it is when uncaptured): placeholders resolved,
        new pages written, the forward, and with a head the logits and their argmax."""
        io = self._io[:, :bs]
        io[_TOKEN].copy_(resolve_placeholders(io[_TOKEN], self.next_tokens))
        self.pages.cells.index_copy_(0, io[_CELL], io[_PAGE].to(torch.int32))
        hidden = self.model(fb)
        self._outputs[bs] = hidden
        if self.head is not None:
            logits = self._logits[bs] = self.head(hidden)
            z = logits[:, : self.vocab_size]
            temps = io[_TEMP].view(torch.float32)[0::2]  # each int64's low half: the float32 bits (no launch)
            if z.is_cuda:
                from deepinfer_kernels.sampling import gumbel_argmax

                gumbel_argmax(z, io[_SEED], temps, out=self.next_tokens[:bs], keys=self._keys)
            else:
                self.next_tokens[:bs].copy_(_host_draws(z, io[_SEED], temps))

    def _forward_batch(self, bs: int) -> ForwardBatch:
        io = self._io[:, :bs]
        fb = ForwardBatch(input_ids=io[_TOKEN], positions=io[_POS], out_slots=io[_SLOT], q_lens=[1] * bs,
                          kv_lens=[1] * bs, kv_slots=[], pool=self.pool, backend=self.backend,
                          pages=DevicePages(self.pages.table, io[_ROW], self.page_size))
        if self.backend is not None:  # None: a model that reads no backend metadata (uncaptured CPU runs)
            from deepinfer_rt.layers.attention.triton import TritonMeta

            decode = self.backend.decode_meta(self.pages.table, io[_ROW], io[_LEN], self.page_size,
                                              *self.pool.k[0].shape[1:])
            fb.attn_meta = TritonMeta(decode, None)
        self.model.prepare_graph_batch(fb, io[_LEN])
        return fb

    @torch.no_grad()
    def _capture_all(self) -> None:
        self._padding(0)
        # Distinct tokens for the warm-up runs: kernels autotuned on their first call (the fused MoE) then see
        # tokens routed to many experts, as in real decode steps, not every token on the same few.
        vocab = self.model.config.vocab_size
        self._stage[_TOKEN] = torch.randint(0, vocab, (self.max_bs,), generator=torch.Generator().manual_seed(0))
        self._io.copy_(self._stage)
        if not self.is_captured:
            self._graphs = {bs: self._forward_batch(bs) for bs in self.batch_sizes}
            return
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: the smaller graphs reuse its memory
                fb = self._forward_batch(bs)
                with self.capture_scope(bs, self._io[_LEN, :bs]):
                    self._body(bs, fb)  # compiles the kernels and fills lazy tables outside the capture
                    if not self._graphs and self._syncs_host(fb):
                        break
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=mempool, stream=stream):
                        self._body(bs, fb)
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
        most = self.max_bs if self.step_batch_size is None else self.step_batch_size
        return (bool(self._graphs) and 0 < len(items) <= most and all(it.num_new_tokens == 1 for it in items)
                and max(it.start for it in items) < self.max_context
                and (self.step_batch_size is None or self.step_batch_size in self._graphs))

    def graph_size(self, num_rows: int) -> int | None:
        """The smallest graph that holds num_rows rows, or None."""
        return next((b for b in self.batch_sizes if b >= num_rows and b in self._graphs), None)

    def prefetch_pages(self, reqs: list[Req]) -> None:
        """Give rows to requests whose prefill ends in the step being computed and upload their page lists now,
        from the eager step once its forward is launched, where this host work overlaps the GPU's: their first
        graph step then uploads one page each instead of the prompt's pages, with the GPU waiting. Takes only
        free rows, and skips (never waits) while the staging buffer may still be read."""
        new = [r for r in reqs if not self.pages.has_row(r)]
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
        appends: list[int] = []
        rows = self.pages.rows(reqs, appends)  # from here on the step must run: its new pages are in `appends`
        if rows is None:
            return None
        n = len(reqs)
        bs = self.graph_size(n) if self.step_batch_size is None else self.step_batch_size
        ps = self.page_size
        positions = [it.start for it in batch.items]
        for r, p in zip(reqs, positions):
            # The replayed step must read all the KV the real one would: the row covers the whole context.
            assert p // ps < len(r.pages) <= self.pages.width, \
                f"request {r.rid}: page table row of {len(r.pages)} pages does not cover position {p}"
        self.model.prepare_graph_step(self.pool, reqs, positions)
        st = self._stage_np  # numpy rows of the pinned buffer: a few microseconds for what torch.tensor took tens
        st[_TOKEN, :n] = input_ids if input_ids is not None else [r.token_ids[p] for r, p in zip(reqs, positions)]
        st[_POS, :n] = positions
        st[_SLOT, :n] = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, positions)]
        st[_ROW, :n] = rows
        st[_LEN, :n] = st[_POS, :n] + 1
        st[_CELL, :n] = appends[0::2]
        st[_PAGE, :n] = appends[1::2]
        st[_SEED, :n] = st[_TEMP, :n] = 0
        if self.head is not None:  # greedy rows keep temperature 0: the argmax
            drawn = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
            if drawn:
                st[_TEMP, drawn] = np.array([reqs[i].params.temperature for i in drawn], np.float32).view(np.int32)
                st[_SEED, drawn] = stream_seeds([reqs[i].seed for i in drawn],
                                                [reqs[i].num_output_tokens for i in drawn])
        self._padding(n)
        self._io.copy_(self._stage, non_blocking=True)  # whole buffer: a strided copy would stage through pageable memory
        self._staged.record()
        if future is not None and not _is_view_of(future, self.next_tokens):
            self.next_tokens[: future.shape[0]].copy_(future)  # tokens the sampler chose: the graph reads them here
        if self.is_captured:
            self._graphs[bs].replay()
        else:
            with self.capture_scope(bs, self._io[_LEN, :bs]):
                self._body(bs, self._graphs[bs])
        self.num_replays += 1
        self.last_size = bs
        return self._outputs[bs][:n]

    def logits(self, n: int) -> torch.Tensor | None:
        """The last replay's logits of its first n rows, when the graphs hold the head."""
        return None if self.head is None else self._logits[self.last_size][:n]

    def graph_tokens(self, n: int) -> torch.Tensor:
        """The last replay's tokens of its first n rows (graphs with a head), on the device: a view of
        `next_tokens`, which the next replay reads as it is and then overwrites (consume it before)."""
        return self.next_tokens[:n]

    def replay_step(self, bs: int) -> torch.Tensor:
        """Replay the graph of bs rows as the last step ran it, through its tokens (benchmarks time this: what
        a greedy decode step computes on the GPU). Without a head in the graph, the logits and argmax follow."""
        self._graphs[bs].replay()
        if self.head is not None:
            return self.next_tokens[:bs]
        return self.model.compute_logits(self._outputs[bs]).argmax(-1)

    def check_covers(self, reqs: list[Req], lengths: list[int] | None = None) -> None:
        """Raise unless the inputs of the last replay attend to each request's whole context (`lengths`, by
        default the computed tokens) through rows that hold its page list (benchmarks replay those inputs: the
        replay must read the real step's KV)."""
        n = len(reqs)
        io = self._io[:, :n].cpu()
        for i, r in enumerate(reqs):
            row, length = int(io[_ROW, i]), int(io[_LEN, i])
            want = r.num_computed_tokens if lengths is None else lengths[i]
            if length != want:
                raise AssertionError(f"request {r.rid}: the last replay attended {length} of {want} tokens")
            need = -(-length // self.page_size)
            held = self.pages.table[row, :need].tolist()
            if held != r.pages[:need]:
                raise AssertionError(f"request {r.rid}: its page table row does not hold its {need} pages")


def _host_draws(z: torch.Tensor, seeds: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """gumbel_argmax's tokens with the sampler's CPU noise (uncaptured steps on a CPU pool): the argmax of rows of
    temperature 0, the sampler's draw (draw_streams) over z / t of the others."""
    tokens = z.argmax(-1)
    rows = (temps != 0).nonzero().flatten()
    if rows.numel():
        tokens[rows] = draw_streams(z[rows] / temps[rows, None], seeds[rows].tolist())
    return tokens


def _is_view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether t is base's leading rows (the graph's own tokens, already where the next graph reads them)."""
    return t.device == base.device and t.data_ptr() == base.data_ptr()


class _HostEvent:
    """The staging event of a runner on a CPU pool, whose copies are done when they return."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True
