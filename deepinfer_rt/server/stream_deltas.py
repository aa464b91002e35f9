"""Stream deltas of running requests: after each engine step, each sequence's new token ids, its new text and
logprobs.

The engine detokenizes in its step loop already (stop strings end a request there, so the text must exist
there), so this stage reads each request's incremental detokenizer instead of decoding a second time in a
process of its own: one decode per token, and the deltas leave the scheduler process in one batched message
per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_rt.request import Req
from deepinfer_rt.server.io_struct import SeqDelta


@dataclass
class TrackedRequest:
    """The engine sequences of one submitted request and how much of each was already sent."""
    rid: str
    seqs: list[Req]
    num_sent: list[int] = field(default_factory=list)
    is_done: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_sent = [0] * len(self.seqs)
        self.is_done = [False] * len(self.seqs)

    @property
    def is_finished(self) -> bool:
        return all(self.is_done)


def take_deltas(tracked: TrackedRequest) -> list[SeqDelta]:
    """Deltas of every sequence that made progress (or finished) since the last call."""
    deltas = []
    for k, req in enumerate(tracked.seqs):
        if tracked.is_done[k]:
            continue
        finished = req.is_finished
        start = tracked.num_sent[k]
        new_ids = req.output_ids[start:]
        text = req.detokenizer.take_delta(finished)
        if not new_ids and not text and not finished:
            continue
        delta = SeqDelta(tracked.rid, k, new_ids, text, logprobs=req.logprobs[start:],
                         top_logprobs=req.top_logprobs[start:], prompt_tokens=req.prompt_len,
                         completion_tokens=req.num_output_tokens, cached_tokens=req.num_cached_tokens)
        if finished:
            delta.finish_reason = req.finish_reason or "abort"
            delta.error = req.error
            if req.params.prompt_logprobs:
                delta.prompt_logprobs = list(req.prompt_logprobs)
            if req.params.num_prompt_top_logprobs:
                delta.prompt_top_logprobs = list(req.prompt_top_logprobs)
            tracked.is_done[k] = True
        tracked.num_sent[k] = req.num_output_tokens
        deltas.append(delta)
    return deltas
