"""ModelRunner, the local executor: ScheduledBatch (plain data) -> ForwardBatch tensors -> model -> logits rows
-> Sampler.

Makes no policy decisions: it computes exactly the tokens the scheduler handed it and returns, per item, the
sampled token (items that catch up), the prompt logprobs of the chunk (items that asked) and, with speculation,
how many drafts verification accepted.

Overlap (`launch` before the step before is collected): a decode step whose sampling needs nothing from the
host but the requests' counts is launched while the step before still computes on the device. Its rows whose
input is the token that step sampled (not on the host yet) read it on the device: the ids uploaded for such a
row are a placeholder -1 - k (k: the row of that token in the previous step's output) that
`resolve_placeholders` swaps for the real id before the embedding. Placeholders exist only inside the runner's
input tensors, never in a request.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from deepinfer_rt.cache.kv_pool import KVPool, slots_of
from deepinfer_rt.cache.page_table import DevicePages, PageTable, pages_per_request
from deepinfer_rt.forward_batch import ForwardBatch, TableSlots, resolve_placeholders
from deepinfer_rt.layers.attention.base import AttentionBackend
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.sampler import Sampler, SampleResult, to_device
from deepinfer_rt.scheduler.batch import ScheduledBatch, ScheduledReq


@dataclass
class RunResult:
    sampled: list[tuple[int, int]]
    """(item index, token) for items that sampled."""
    sample: SampleResult | None
    prompt_logprobs: dict[int, tuple[int, list[float], list[list[tuple[int, float]]] | None]]
    """item index -> (first prompt position, logprobs of the prompt tokens from there, the top (token, logprob)
    pairs at each of those positions when the request asked for a count) computed in the chunk."""
    num_accepted: dict[int, int] = field(default_factory=dict)
    """Speculation: item index -> how many of its draft tokens verification accepted."""

    def logprobs_of(self, j: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        """Logprob and top logprobs of sampled[j] (verified drafts, listed after the sampler's rows, have none)."""
        s = self.sample
        if s is None or j >= len(s.token_ids):
            return None, None
        return (s.logprobs[j] if s.logprobs is not None else None,
                s.top_logprobs[j] if s.top_logprobs is not None else None)


@dataclass
class Launched:
    """A launched step. Synchronous steps carry their result; overlapped ones their sampled tokens on the device
    and a pinned host copy that is valid once `ready` has completed."""
    result: RunResult | None = None
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    rows: dict[int, int] = field(default_factory=dict)
    """Request id -> row of its token in `tokens`."""


def is_overlappable(batch: ScheduledBatch) -> bool:
    """Every item decodes one token whose sampling needs nothing from the host but the request's counts."""
    for item in batch.items:
        req, p = item.req, item.req.params
        if item.num_new_tokens != 1 or item.draft_tokens or not item.is_sampling or item.wants_prompt_logprobs:
            return False
        if req.grammar is not None or p.logprobs or p.top_logprobs or req.num_output_tokens < p.min_new_tokens:
            return False
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            return False
    return bool(batch.items)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend, sampler: Sampler,
                 device: torch.device, eos_ids: tuple[int, ...], is_overlap_enabled: bool = False,
                 graphs=None, spec=None, max_num_seqs: int = 256, max_context: int | None = None):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.eos_ids = eos_ids
        self.is_overlap_enabled = is_overlap_enabled
        """Overlap scheduling (DEEPINFER_OVERLAP; on by default on CUDA): decode steps launched ahead."""
        self.graphs = graphs
        """CUDA-graph runner for decode batches (deepinfer_rt.cuda_graph), on GPU."""
        num_pages = pool.num_slots // pool.page_size
        self.pages = graphs.pages if graphs is not None else PageTable(
            max_num_seqs + 8, pages_per_request(max_context or pool.num_slots, num_pages, pool.page_size), device)
        """Each running request's page list on the device, kept up to date step by step (shared with the
        graphs): a step uploads only new pages, never a request's whole context."""
        self.spec = spec
        """SpecDecoder when speculation is on: verifies items carrying drafts, updates the drafter."""
        self.grammar = None
        """The structured-output backend, given by the engine once a constrained request arrived (it is built on
        first use): masks logits rows."""

    # ---- the executor contract (deepinfer_rt/executor.py) ----
    @property
    def allocator(self):
        return self.pool.allocator

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def can_overlap(self, batch: ScheduledBatch) -> bool:
        if not self.is_overlap_enabled or self.spec is not None:
            return False
        if batch.is_overlappable is None:
            batch.is_overlappable = is_overlappable(batch)
        return batch.is_overlappable

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch, prev: Launched | None = None) -> Launched:
        for src, dst in batch.kv_copies:
            self.pool.copy_slots(src, dst)
        if self.can_overlap(batch):
            return self._launch_overlapped(batch, prev)
        return Launched(result=self._run(batch, prev))

    def collect(self, handle: Launched) -> RunResult:
        if handle.result is not None:
            return handle.result
        if handle.ready is not None:
            handle.ready.synchronize()
        tokens = handle.host.tolist()
        return RunResult(list(enumerate(tokens)), SampleResult(tokens, None, None), {})

    def run(self, batch: ScheduledBatch) -> RunResult:
        return self.collect(self.launch(batch))

    def shutdown(self) -> None:
        pass

    # ---- building the step ----
    def input_ids(self, batch: ScheduledBatch, prev: Launched | None) -> list[int]:
        """The ids each item feeds; a token still on the device (sampled by `prev`) as its placeholder."""
        ids = []
        if prev is not None and all(it.num_new_tokens == 1 for it in batch.items):  # a decode step: one id each
            rows = prev.rows
            for item in batch.items:
                tokens, start = item.req.token_ids, item.start
                ids.append(tokens[start] if start < len(tokens) else -1 - rows[item.req.rid])
            return ids
        for item in batch.items:
            req, start, n = item.req, item.start, item.num_input_tokens
            known = req.token_ids[start : start + n]
            if len(known) < n:  # its last input is the token `prev` sampled
                assert prev is not None and n - len(known) == 1, f"request {req.rid}: input ids are missing"
                known = known + [-1 - prev.rows[req.rid]]
            ids.extend(known)
            ids.extend(item.draft_tokens)
        return ids

    def build(self, batch: ScheduledBatch, prev: Launched | None = None) -> ForwardBatch:
        """The step's tensors. Host work is O(new tokens + new pages): each request's context is read through
        its page table row on the device, speculative steps' too (drafts are new tokens; their pages, given back
        when rejected, are cut in place and only the pages from the cut on are uploaded again). Without a free
        row the slot lists are built on the host."""
        rows = self.pages.rows([it.req for it in batch.items])
        if rows is None:
            return self._build_listed(batch, prev)
        positions, out_slots, q_lens, kv_lens = [], [], [], []
        ps = self.pool.page_size
        for item in batch.items:
            req, start, n = item.req, item.start, item.num_new_tokens
            positions.extend(range(start, start + n))
            out_slots.extend(_new_slots(req.pages, start, n, ps))
            q_lens.append(n)
            kv_lens.append(start + n)
        ids = self.input_ids(batch, prev)
        t = len(ids)
        flat = to_device(list(itertools.chain(ids, positions, out_slots, rows)), torch.long, self.device)
        pages = DevicePages(self.pages.table, flat[3 * t :].to(torch.int32), ps)
        fb = ForwardBatch(input_ids=flat[:t], positions=flat[t : 2 * t], out_slots=flat[2 * t : 3 * t],
                          q_lens=q_lens, kv_lens=kv_lens, kv_slots=TableSlots(pages, rows, kv_lens), pool=self.pool,
                          backend=self.backend, pages=pages)
        if prev is not None and prev.tokens is not None:
            fb.input_ids = resolve_placeholders(fb.input_ids, prev.tokens)
        self.backend.prepare(fb)
        self.model.prepare_batch(fb)
        return fb

    def _build_listed(self, batch: ScheduledBatch, prev: Launched | None) -> ForwardBatch:
        """`build` with every sequence's slot list built on the host and uploaded (O(context) per step)."""
        positions, out_slots, q_lens, kv_lens, kv_slots = [], [], [], [], []
        ps = self.pool.page_size
        for item in batch.items:
            req, start, n = item.req, item.start, item.num_new_tokens
            slots = slots_of(req.pages, start + n, ps)
            positions.extend(range(start, start + n))
            out_slots.extend(slots[start:])
            q_lens.append(n)
            kv_lens.append(start + n)
            kv_slots.append(slots)
        fb = self.forward_batch(self.input_ids(batch, prev), positions, out_slots, q_lens, kv_lens, kv_slots)
        if prev is not None and prev.tokens is not None:
            fb.input_ids = resolve_placeholders(fb.input_ids, prev.tokens)
        return fb

    def forward_batch(self, ids: list[int], positions: list[int], out_slots: list[int], q_lens: list[int],
                      kv_lens: list[int], kv_slots: list[list[int]]) -> ForwardBatch:
        """Flattened varlen rows (plain lists) -> device tensors, prepared by the attention backend."""
        # One upload for the whole batch (a copy per sequence cost a host sync each on a GPU).
        t = len(ids)
        flat = to_device(list(itertools.chain(ids, positions, out_slots, *kv_slots)), torch.long, self.device)
        fb = ForwardBatch(
            input_ids=flat[:t], positions=flat[t : 2 * t], out_slots=flat[2 * t : 3 * t],
            q_lens=q_lens, kv_lens=kv_lens, kv_slots=list(flat[3 * t :].split([len(s) for s in kv_slots])),
            pool=self.pool, backend=self.backend)
        self.backend.prepare(fb)
        self.model.prepare_batch(fb)
        return fb

    def stats(self) -> dict:
        return {"num_uploaded_pages": self.pages.num_uploaded_pages}

    def _hidden(self, batch: ScheduledBatch, prev: Launched | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's hidden rows, and its logits where a CUDA graph with the head computed them."""
        if self.graphs is not None:
            hidden = self.graphs.run(batch, self.input_ids(batch, prev) if prev is not None else None,
                                     prev.tokens if prev is not None else None)
            if hidden is not None:
                return hidden, self.graphs.logits(hidden.shape[0])
        hidden = self.model(self.build(batch, prev))
        if self.graphs is not None:
            self.graphs.prefetch_pages([it.req for it in batch.items if it.is_sampling])
        return hidden, None

    def _launch_overlapped(self, batch: ScheduledBatch, prev: Launched | None) -> Launched:
        """Forward and sample `batch` on the device, reading in-flight inputs from `prev`; no host sync."""
        reqs = [it.req for it in batch.items]
        hidden, logits = self._hidden(batch, prev)
        if logits is not None and self.sampler.takes_graph_tokens(reqs):
            tokens = self.graphs.graph_tokens(len(reqs))  # the graph's own tokens: nothing to launch
        else:
            tokens = self.sampler.sample(self.model.compute_logits(hidden) if logits is None else logits, reqs,
                                         self.eos_ids)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:  # a copy: the graph's tokens are a view of a buffer that the next step rewrites before collect
            host, ready = tokens.clone(), None
        return Launched(tokens=tokens, host=host, ready=ready, rows={r.rid: k for k, r in enumerate(reqs)})

    def _run(self, batch: ScheduledBatch, prev: Launched | None) -> RunResult:
        t0 = time.perf_counter()
        hidden, graph_logits = self._hidden(batch, prev)
        sample_rows, sampled_items, lp_rows, spec_rows = [], [], {}, {}
        row = 0
        for i, item in enumerate(batch.items):
            n = item.num_new_tokens
            if item.wants_prompt_logprobs:
                lp_rows[i] = (row, n)
            if item.is_sampling and item.draft_tokens:
                spec_rows[i] = row
            elif item.is_sampling:
                sample_rows.append(row + n - 1)
                sampled_items.append(i)
            row += n
        sample = None
        if sample_rows:
            if graph_logits is not None and len(sample_rows) == hidden.shape[0]:
                logits = graph_logits  # a decode step's graph computed them
            else:
                logits = self.model.compute_logits(hidden if len(sample_rows) == hidden.shape[0]
                                                   else hidden[sample_rows])
            reqs = [batch.items[i].req for i in sampled_items]
            bitmask_fn = None
            if any(r.grammar is not None for r in reqs):
                grammars = [r.grammar for r in reqs]
                bitmask_fn = lambda rows: self.grammar.fill_and_apply(rows, grammars)  # noqa: E731
            sample = self.sampler(logits, reqs, self.eos_ids, bitmask_fn)
        prompt_lps = {i: self._prompt_logprobs(hidden, batch.items[i], r, n) for i, (r, n) in lp_rows.items()}
        sampled = list(zip(sampled_items, sample.token_ids)) if sample else []
        num_accepted = {}
        if self.spec is not None:
            verified, num_accepted = self.spec.verify(self, batch, hidden, spec_rows)
            sampled += verified
            self.spec.observe(self, batch, hidden, sampled, time.perf_counter() - t0)
        return RunResult(sampled, sample, prompt_lps, num_accepted)

    def _prompt_logprobs(self, hidden: torch.Tensor, item: ScheduledReq, row: int, n: int
                         ) -> tuple[int, list[float], list[list[tuple[int, float]]] | None]:
        """Row j predicts the token at position start + j + 1. Returns (first position, logprobs, top tokens
        or None) for the prompt positions in this chunk that the request still needs."""
        req, start = item.req, item.start
        k = req.params.num_prompt_top_logprobs
        first = max(start, len(req.prompt_logprobs) - 1)  # rows before it predict positions already known
        num = min(start + n, req.prompt_len - 1) - first
        if num <= 0:
            return first + 1, [], [] if k else None
        rows = hidden[row + first - start : row + first - start + num]
        logprobs = self.model.compute_logits(rows)[:, : self.sampler.vocab_size].float().log_softmax(-1)
        targets = torch.tensor(req.prompt_ids[first + 1 : first + 1 + num], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        if not k:
            return first + 1, chosen, None
        vals, ids = logprobs.topk(k, dim=-1)
        return first + 1, chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


def _new_slots(pages: list[int], start: int, n: int, page_size: int) -> list[int]:
    """Slots of positions start .. start + n - 1 (what a step writes), read from the request's pages."""
    if page_size == 1:
        return pages[start : start + n]
    return [pages[p // page_size] * page_size + p % page_size for p in range(start, start + n)]
