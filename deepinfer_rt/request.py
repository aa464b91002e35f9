"""Req: the one object that carries a request from submission to finish.

Invariant: num_computed_tokens <= num_tokens = len(token_ids) + num_inflight_tokens = prompt_len + num_output_tokens.
KV of positions 0 .. num_computed_tokens - 1 is in the pool at slots_of(pages, ...); a step computes the next
chunk and, when the request catches up (num_computed_tokens == num_tokens), samples one more token.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.stats import spec_stats


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    """Effective seed of this request's draws (the user's seed, mixed with the sibling index when n > 1)."""
    token_ids: list[int] = field(init=False)
    status: ReqStatus = ReqStatus.WAITING
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    spare_pages: list[int] = field(default_factory=list)
    """Pages taken ahead of need for decode locality (held, not yet covering tokens)."""
    num_page_cuts: int = 0
    """Times `pages` was cut short in place (`cut_pages`); with `num_pages_at_last_cut`, what lets a mirror of
    the list (the device page table) keep its unchanged head instead of reading the whole list again."""
    num_pages_at_last_cut: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache or a sibling instead of being computed."""
    cache_node: Any = None
    """Radix-tree node locked on behalf of this request (its cached prefix), or None."""
    num_locked_tokens: int = 0
    leader: "Req | None" = None
    """For n > 1: the sibling that prefills the shared prompt; the others copy its KV."""
    grammar_handle: Any = None
    """Pending grammar compilation (constrained requests); `grammar` is set once it is ready."""
    grammar: Any = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    """The output's text; for a request without stop strings, as of its last read (the detokenizer decodes when
    read), and whole once finished."""
    detokenizer: Any = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    """With a prompt_logprobs count k: the k most likely (token, logprob) at each prompt position, parallel to
    prompt_logprobs (None where that is None)."""
    penalty_state: Any = None
    """Device-side token counts for repetition / frequency / presence penalties (sampler.PenaltyState), grown
    step by step."""
    draft_index: Any = None
    """Speculation by prompt lookup: this request's n-grams, indexed as its tokens arrive
    (speculative.drafter.NgramIndex)."""
    num_inflight_tokens: int = 0
    """Tokens sampled by a launched step whose ids are still on the device (overlap scheduling): counted in
    num_tokens, appended to token_ids when that step is completed."""
    num_retractions: int = 0
    num_draft_tokens: int = 0
    """Speculation: draft tokens verified for this request, accepted ones, and verification steps."""
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.num_inflight_tokens - len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def is_grammar_pending(self) -> bool:
        return self.grammar_handle is not None and self.grammar is None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return bool(self.params.prompt_logprobs) and len(self.prompt_logprobs) < self.prompt_len

    def cut_pages(self, num_pages: int) -> list[int]:
        """Cut `pages` to its first num_pages in place (speculation's rejected drafts); returns the pages cut."""
        cut = self.pages[num_pages:]
        if cut:
            del self.pages[num_pages:]
            self.num_page_cuts += 1
            self.num_pages_at_last_cut = num_pages
        return cut

    def finish(self, reason: str, error: str | None = None) -> None:
        detok = self.detokenizer
        if detok is not None and detok.is_lazy:  # its queued tokens' text (an abort, an error, a length limit)
            try:
                detok.catch_up()
            except Exception as e:  # noqa: BLE001 -- an output that cannot be decoded ends the request with that
                reason, error = "error", error or f"failed to decode the output: {type(e).__name__}: {e}"
            self.text = detok.text
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason
        self.error = error


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    finish_reason: str
    """'stop' | 'length' | 'abort' | 'error'."""
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    spec_stats: dict | None = None
    """Speculation: drafted, accepted, acceptance_rate, mean_accepted_length (None if nothing was drafted)."""

    @classmethod
    def from_req(cls, req: Req) -> "GenerateOutput":
        p = req.params
        return cls(
            text=req.text,
            token_ids=req.output_ids,
            finish_reason=req.finish_reason or "abort",
            error=req.error,
            prompt_tokens=req.prompt_len,
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.num_cached_tokens,
            logprobs=list(req.logprobs) if p.logprobs or p.top_logprobs else None,
            top_logprobs=list(req.top_logprobs) if p.top_logprobs else None,
            prompt_logprobs=list(req.prompt_logprobs) if p.prompt_logprobs else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if p.num_prompt_top_logprobs else None,
            spec_stats=spec_stats(req.num_draft_tokens, req.num_accepted_tokens, req.num_spec_steps)
            if req.num_spec_steps else None,
        )
