"""Plain data handed from the scheduler to the executor: what each request computes in one step.

A `ScheduledReq` is a snapshot taken when the step is scheduled: its counts keep their meaning after the
scheduler has moved the request on (`update`), and the executor never writes into it. The request object rides
along for the state the sampler reads (params, seed, output history for penalties, grammar) and for its page
list; results (sampled tokens, accepted drafts) come back in the executor's RunResult.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from deepinfer_rt.request import Req


class ScheduledReq(NamedTuple):
    """Immutable (a tuple: cheap to build for every request of every step)."""
    req: Req
    start: int
    """num_computed_tokens when scheduled: this step computes positions start .. start + num_new_tokens - 1."""
    num_new_tokens: int
    is_sampling: bool
    """The step brings the request up to date (drafts aside), so it samples its next token."""
    draft_tokens: tuple[int, ...] = ()
    """Speculation: drafts verified after the request's last token (counted in num_new_tokens)."""
    wants_prompt_logprobs: bool = False

    @classmethod
    def of(cls, req: Req, num_new_tokens: int) -> "ScheduledReq":
        start = req.num_computed_tokens
        return cls(req, start, num_new_tokens, start + num_new_tokens == req.num_tokens, (),
                   start < req.prompt_len and req.wants_prompt_logprobs)

    def with_drafts(self, drafts: list[int]) -> "ScheduledReq":
        return self._replace(draft_tokens=tuple(drafts), num_new_tokens=self.num_new_tokens + len(drafts))

    @property
    def rid(self) -> int:
        return self.req.rid

    @property
    def num_input_tokens(self) -> int:
        """Tokens of the request's own sequence fed this step (the drafts follow them)."""
        return self.num_new_tokens - len(self.draft_tokens)


@dataclass
class ScheduledBatch:
    items: list[ScheduledReq] = field(default_factory=list)
    kv_copies: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """KV slot copies (source slots, destination slots) the executor makes before the forward: a sibling of an
    n > 1 request starting from its leader's partly filled last page."""
    is_overlappable: bool | None = None
    """Memo of model_runner.is_overlappable (asked by the engine and by the launch)."""

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new_tokens for it in self.items)

    @property
    def is_empty(self) -> bool:
        return not self.items

    def unfinished(self) -> "ScheduledBatch":
        """The items whose request is still unfinished (one may finish between scheduling and launch, when the
        step before it is completed)."""
        if not any(it.req.is_finished for it in self.items):
            return self
        return ScheduledBatch([it for it in self.items if not it.req.is_finished], self.kv_copies)
