"""ModelRunner: ScheduledBatch (plain data) -> ForwardBatch tensors -> model -> logits rows -> Sampler.

Makes no policy decisions: it computes exactly the tokens the scheduler handed it and returns, per item,
the sampled token (items that catch up) and the prompt logprobs of the chunk (items that asked).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from deepinfer_rt.cache.kv_pool import KVPool, slots_of
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.overlap import resolve_placeholders
from deepinfer_rt.sampler import Sampler, SampleResult, to_device
from deepinfer_rt.scheduler.batch import ScheduledBatch


@dataclass
class RunResult:
    sampled: list[tuple[int, int]]
    """(item index, token) for items that sampled."""
    sample: SampleResult | None
    prompt_logprobs: dict[int, tuple[int, list[float]]]
    """item index -> (first prompt position, logprobs of the prompt tokens from there) computed in the chunk."""

    def logprobs_of(self, j: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        """Logprob and top logprobs of sampled[j] (verified drafts, listed after the sampler's rows, have none)."""
        s = self.sample
        if s is None or j >= len(s.token_ids):
            return None, None
        return (s.logprobs[j] if s.logprobs is not None else None,
                s.top_logprobs[j] if s.top_logprobs is not None else None)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend, sampler: Sampler,
                 device: torch.device, eos_ids: tuple[int, ...], batch_invariant: bool = False):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.eos_ids = eos_ids
        self.batch_invariant = batch_invariant
        self.grammar = None
        """The structured-output backend once a constrained request arrived (masks logits rows)."""
        self.graphs = None
        """CUDA-graph runner for decode batches (deepinfer_rt.cuda_graph), set by the engine on GPU."""
        self.spec = None
        """SpecDecoder when speculation is on: verifies items carrying drafts, updates the drafter."""
        self.future_tokens: torch.Tensor | None = None
        """Overlap scheduling: the previous step's sampled tokens, still on the device; token ids
        written as placeholders (deepinfer_rt.overlap) are read from it."""

    def build(self, batch: ScheduledBatch) -> ForwardBatch:
        ids, positions, out_slots, q_lens, kv_lens, kv_slots = [], [], [], [], [], []
        ps = self.pool.page_size
        for item in batch.items:
            req, start, n = item.req, item.start, item.num_new_tokens
            slots = slots_of(req.pages, start + n, ps)
            ids.extend(req.token_ids[start : start + n - len(item.draft_tokens)] + item.draft_tokens)
            positions.extend(range(start, start + n))
            out_slots.extend(slots[start:])
            q_lens.append(n)
            kv_lens.append(start + n)
            kv_slots.append(slots)
        return self.forward_batch(ids, positions, out_slots, q_lens, kv_lens, kv_slots)

    def forward_batch(self, ids: list[int], positions: list[int], out_slots: list[int], q_lens: list[int],
                      kv_lens: list[int], kv_slots: list[list[int]]) -> ForwardBatch:
        """Flattened varlen rows (plain lists) -> device tensors, prepared by the attention backend."""
        # One upload for the whole batch (a copy per sequence cost a host sync each on a GPU).
        t = len(ids)
        flat = to_device(list(itertools.chain(ids, positions, out_slots, *kv_slots)), torch.long, self.device)
        input_ids = flat[:t]
        if self.future_tokens is not None:
            input_ids = resolve_placeholders(input_ids, self.future_tokens)
        fb = ForwardBatch(
            input_ids=input_ids, positions=flat[t : 2 * t], out_slots=flat[2 * t : 3 * t],
            q_lens=q_lens, kv_lens=kv_lens, kv_slots=list(flat[3 * t :].split([len(s) for s in kv_slots])),
            pool=self.pool, backend=self.backend)
        self.backend.prepare(fb)
        self.model.prepare_batch(fb)
        return fb

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> RunResult:
        return self._run(batch)

    def _run(self, batch: ScheduledBatch) -> RunResult:
        t0 = time.perf_counter()
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(self.build(batch))
            if self.graphs is not None:
                self.graphs.prefetch_pages([it.req for it in batch.items if it.samples])
        sample_rows, sampled_items, lp_rows, spec_rows = [], [], {}, {}
        row = 0
        for i, item in enumerate(batch.items):
            n = item.num_new_tokens
            if item.wants_prompt_logprobs:
                lp_rows[i] = (row, n)
            if item.samples and item.draft_tokens:
                spec_rows[i] = row
            elif item.samples:
                sample_rows.append(row + n - 1)
                sampled_items.append(i)
            row += n
        sample = None
        if sample_rows:
            rows = hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows]
            logits = self.model.compute_logits(rows)
            reqs = [batch.items[i].req for i in sampled_items]
            bitmask_fn = None
            if any(r.grammar is not None for r in reqs):
                grammars = [r.grammar for r in reqs]
                bitmask_fn = lambda rows: self.grammar.fill_and_apply(rows, grammars)  # noqa: E731
            sample = self.sampler(logits, reqs, self.eos_ids, bitmask_fn)
        prompt_lps = {i: self._prompt_logprobs(hidden, batch.items[i], r, n) for i, (r, n) in lp_rows.items()}
        sampled = list(zip(sampled_items, sample.token_ids)) if sample else []
        if self.spec is not None:
            sampled += self.spec.verify(self, batch, hidden, spec_rows)
            self.spec.observe(self, batch, hidden, sampled, time.perf_counter() - t0)
        return RunResult(sampled, sample, prompt_lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, item, row: int, n: int) -> tuple[int, list[float]]:
        """Row j predicts the token at position start + j + 1. Returns (first position, logprobs) for the
        prompt positions in this chunk that the request still needs."""
        req, start = item.req, item.start
        first = max(start, len(req.prompt_logprobs) - 1)  # rows before it predict positions already known
        num = min(start + n, req.prompt_len - 1) - first
        if num <= 0:
            return first + 1, []
        rows = hidden[row + first - start : row + first - start + num]
        logits = self.model.compute_logits(rows)[:, : self.sampler.vocab_size]
        targets = torch.tensor(req.prompt_ids[first + 1 : first + 1 + num], device=logits.device)
        return first + 1, logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1).tolist()
