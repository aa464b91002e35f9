"""Overlap scheduling: the host prepares and launches step N while the device still computes step N - 1.

A decode step's sampled tokens stay on the device. The next step is scheduled before they reach the host:
each request waiting on one carries a placeholder id in its token_ids for the scheduler's counts (-1 - row
of the token in the previous step's output), and the step's input reads the real id on the device
(`resolve_placeholders`). Once step N is launched, step N - 1's tokens are read back (waiting on that step
only) and applied as the synchronous engine would: detokenization, stop conditions, finishing and freeing.
A request that finished at N - 1 was computed once more at N; that token is dropped.

Between steps no placeholder is left in any token_ids: readers outside the step (stream deltas, the server)
see real tokens only (a request whose token is in flight looks caught up: num_computed_tokens == num_tokens).
Steps that need their tokens on the host first -- prefill chunks, speculation, grammars, logprobs, penalties,
a min_new_tokens ban -- run synchronously after the pending step is applied, so outputs are token-identical
to the synchronous engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer_rt.request import Req
from deepinfer_rt.scheduler.batch import ScheduledBatch

if TYPE_CHECKING:
    from deepinfer_rt.engine import Engine


def resolve_placeholders(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """Token ids with placeholders (-1 - k) replaced by future[k], on the device."""
    index = (-1 - ids).clamp_(0, future.shape[0] - 1)
    return torch.where(ids < 0, future[index], ids)


@dataclass
class _Pending:
    """A launched step whose tokens are not applied yet: reqs[k] sampled tokens[k]."""
    reqs: list[Req]
    tokens: torch.Tensor
    host: torch.Tensor
    """Pinned host copy of `tokens`, valid once `ready` has completed."""
    ready: torch.cuda.Event | None
    placed: list[bool] | None = None
    """Per request: a placeholder was appended to its token_ids for the step being scheduled (set by
    `place`, which every step does before it applies the tokens)."""

    def place(self) -> None:
        """Append each live request's placeholder (finished ones, e.g. aborted, get none)."""
        self.placed = [not r.is_finished for r in self.reqs]
        for k, (req, placed) in enumerate(zip(self.reqs, self.placed)):
            if placed:
                req.token_ids.append(-1 - k)

    def take(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def overlappable(batch: ScheduledBatch) -> bool:
    """Every item decodes one token whose sampling needs nothing from the host but the request's counts."""
    for item in batch.items:
        req, p = item.req, item.req.params
        if item.num_new_tokens != 1 or item.draft_tokens or not item.samples or item.wants_prompt_logprobs:
            return False
        if req.grammar is not None or p.logprobs or p.top_logprobs or req.num_output_tokens < p.min_new_tokens:
            return False
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            return False
    return True


class OverlapScheduler:
    """Drives Engine.step when DEEPINFER_OVERLAP is on (speculation and the EP worker pool keep it off)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: _Pending | None = None

    def step(self) -> list[Req]:
        e = self.engine
        finished = e._poll_grammars()
        prev, self.pending = self.pending, None
        if prev is not None:
            prev.place()
        batch = e.scheduler.schedule()
        overlap = not batch.is_empty and overlappable(batch)
        if prev is not None and not overlap:
            finished += self._apply(prev)
            batch.items = [it for it in batch.items if not it.req.is_finished]
            if batch.is_empty:
                return finished
            prev = None
        if batch.is_empty:
            return finished + e._idle()
        if not overlap:
            result = e.runner.run(batch)
            e.scheduler.update(batch)
            return finished + e._process(batch, result)
        launched = self._launch(batch, prev)
        if prev is not None:
            finished += self._apply(prev)
        live = [it for it in batch.items if not it.req.is_finished]
        e.scheduler.update(ScheduledBatch(live))
        self.pending = launched
        return finished

    @torch.no_grad()
    def _launch(self, batch: ScheduledBatch, prev: _Pending | None) -> _Pending:
        """Forward and sample `batch` on the device, reading placeholders from `prev`; no host sync."""
        runner = self.engine.runner
        future = prev.tokens if prev is not None else None
        reqs = [it.req for it in batch.items]
        hidden = runner.graphs.run(batch, future) if runner.graphs is not None else None
        if hidden is None:
            runner.future_tokens = future
            try:
                hidden = runner.model(runner.build(batch))
            finally:
                runner.future_tokens = None
        tokens = runner.sampler.sample(runner.model.compute_logits(hidden), reqs, runner.eos_ids)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = tokens, None
        return _Pending(reqs, tokens, host, ready)

    def _apply(self, prev: _Pending) -> list[Req]:
        """Apply a launched step's tokens in the synchronous engine's order; returns requests it finished."""
        e = self.engine
        tokens = prev.take()
        live = [(req, token) for req, token, placed in zip(prev.reqs, tokens, prev.placed) if placed]
        for req, _ in live:  # requests not placed were finished (aborted) before this step
            req.token_ids.pop()
        # A request the scheduler finished in this step (it could not grow) still gets the token the
        # synchronous engine appended before scheduling; a stop there takes precedence, as it would.
        done = e.outputs.append_tokens([req for req, _ in live], [token for _, token in live])
        finished = [req for (req, _), d in zip(live, done) if d]
        for req in finished:
            e.scheduler.abort_waiting(req)  # retracted in this step's scheduling
            e.scheduler.finish(req)
        return finished
