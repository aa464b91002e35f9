"""Speculative decoding (prompt lookup) through the EP worker pool.

The drafts are planned in the engine process (the scheduler's SpecDecoder: prompt lookup needs only the
request's tokens) and verified in the worker that serves the request (its ModelRunner's SpecDecoder, with the
drafts of the step shipped in the step message); the accepted counts come back in the RunResult, and the engine
side keeps the per-request acceptance history the next plans read and the step times the planner weighs.
A drafter with a forward of its own (MTP) is refused: its forward would have to join the MoE layers'
collectives of every rank. Constrained requests decode one token a step here (the workers hold no grammar
matcher to mask draft rows with).
"""
from __future__ import annotations

from deepinfer_rt.request import Req
from deepinfer_rt.speculative.config import SpeculativeConfig
from deepinfer_rt.speculative.decoder import SpecDecoder
from deepinfer_rt.speculative.drafter import Drafter, PromptLookupDrafter, Proposal


class EngineSpecDecoder(SpecDecoder):
    """The engine process's half: plans drafts; `record` books what the workers verified."""

    def _proposal(self, req: Req) -> Proposal | None:
        return None if req.grammar is not None else super()._proposal(req)

    def book(self, batch, num_accepted: dict[int, int], seconds: float) -> None:
        """A collected step of `batch`: its items' verified drafts (item index -> accepted) and its time."""
        self.time_model.record(batch.num_tokens, seconds)
        for i, item in enumerate(batch.items):
            if item.draft_tokens:
                self._record(item.req, len(item.draft_tokens), num_accepted.get(i, 0))


def engine_spec_decoder(config: SpeculativeConfig, batch_invariant: bool, max_position: int) -> EngineSpecDecoder:
    """Prompt lookup, or a drafter object that proposes from the request's tokens alone (no KV layers of its
    own and no `observe` of the target's hidden states, which stay in the workers)."""
    drafter = config.drafter
    if drafter is None and config.method != "prompt_lookup":
        raise ValueError(f"speculative={config.method!r} does not run with the expert-parallel worker pool; "
                         "prompt_lookup does")
    if drafter is not None and (drafter.num_kv_layers or type(drafter).observe is not Drafter.observe):
        raise ValueError(f"the drafter {type(drafter).__name__} reads the target model's state, which stays in "
                         "the expert-parallel workers: only drafters proposing from the tokens run there")
    drafter = drafter or PromptLookupDrafter(config.min_ngram, config.max_ngram)
    return EngineSpecDecoder(config, drafter, batch_invariant, max_position)


class _Verified(Drafter):
    """A worker proposes nothing: the engine's plan arrives with each step."""

    def propose(self, req: Req, k: int) -> Proposal | None:
        return None


def worker_spec_decoder(config: SpeculativeConfig, batch_invariant: bool, max_position: int) -> SpecDecoder:
    return SpecDecoder(config, _Verified(), batch_invariant, max_position)


def set_step_drafts(spec: SpecDecoder, drafts: dict[int, tuple[list[int], int]]) -> None:
    """The proposals this step verifies (rid -> (draft tokens, req.num_tokens they continue)): deterministic
    drafts, so the tokens are all verification reads."""
    spec._scheduled = {rid: Proposal(list(tokens), [1.0] * len(tokens), None, num_tokens)
                       for rid, (tokens, num_tokens) in drafts.items()}
