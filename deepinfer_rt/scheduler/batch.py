"""Plain data handed from the scheduler to the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_rt.request import Req


@dataclass
class ScheduledReq:
    req: Req
    num_new_tokens: int
    """Tokens computed this step: positions num_computed_tokens .. num_computed_tokens + num_new_tokens - 1."""
    draft_tokens: list[int] = field(default_factory=list)
    """Speculation: drafts verified after the request's last token (counted in num_new_tokens)."""
    num_accepted: int = 0
    """Speculation: how many of draft_tokens verification accepted (set by the model runner)."""

    @property
    def start(self) -> int:
        return self.req.num_computed_tokens

    @property
    def samples(self) -> bool:
        """The step brings the request up to date, so it samples its next token."""
        return self.req.num_computed_tokens + self.num_new_tokens - len(self.draft_tokens) == self.req.num_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.req.wants_prompt_logprobs and self.start < self.req.prompt_len


@dataclass
class ScheduledBatch:
    items: list[ScheduledReq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new_tokens for it in self.items)

    @property
    def is_empty(self) -> bool:
        return not self.items
