"""Speculative decoding through the EP worker pool: prompt lookup, DeepSeek's MTP head and V4.1's DSpark drafter.

The engine process plans every step's drafts (the scheduler's SpecDecoder) and the worker that serves the
request verifies them (its ModelRunner's SpecDecoder, with the drafts of the step shipped in the step message);
the accepted counts come back in the RunResult, and the engine side keeps the per-request acceptance history
the next plans read and the step times the planner weighs.

Prompt lookup proposes from the request's tokens alone, in the engine. MTP needs the target's hidden states
and its own KV layer, which live in the workers, and its layer has an MoE that must join the rank group's
dispatch/combine: so it runs in every worker after each verify step (`WorkerMTPDrafter`), over that rank's
requests. Its proposals come back with the step's answer as plain arrays (`Drafts`: tokens and confidences;
the draft distributions of sampled requests stay in the worker, which verifies against them next step), and
the engine plans from them as from any drafter's (`ShippedDrafter`).

Collectives line up: every rank runs one MTP forward per step (over the positions it computed, or an empty
one) and then the same number of chain forwards, `StepMsg.draft_forwards`, which the engine sets to
max_draft - 1 when any rank samples this step (0 otherwise); a rank with nothing to draft runs them empty.

DSpark (`WorkerDSparkDrafter`) drafts in the workers the same way: each rank captures the target features of
its own rows during its forward, writes their context keys to its own pool and, after each verify step, runs one
block forward over its requests that sampled; the proposals come back as MTP's do. Its draft expert bank is
whole on every rank (built and loaded as in-process, never sharded), so the drafter runs no collective: a rank
with nothing to draft runs nothing, the engine asks for no chain forwards (draft_forwards stays 0), and every
draft row goes through the very MoE forward of in-process DSpark. That keeps its results the in-process
drafter's (bitwise in batch-invariant mode, where a row's result does not depend on the rows beside it), for
the memory of one draft bank per rank.

Constrained requests decode one token a step here (the workers hold no grammar matcher to mask draft rows
with).
"""
from __future__ import annotations

import math

import torch

from deepinfer_rt.distributed.ep import run_empty
from deepinfer_rt.distributed.messages import Drafts
from deepinfer_rt.request import Req
from deepinfer_rt.speculative.config import SpeculativeConfig
from deepinfer_rt.speculative.decoder import SpecDecoder
from deepinfer_rt.speculative.drafter import Drafter, PromptLookupDrafter, Proposal
from deepinfer_rt.speculative.dspark import DSparkDrafter
from deepinfer_rt.speculative.mtp import MTPDrafter, check_has_mtp


class EngineSpecDecoder(SpecDecoder):
    """The engine process's half: plans drafts; `book` records what the workers verified."""

    def _proposal(self, req: Req) -> Proposal | None:
        return None if req.grammar is not None else super()._proposal(req)

    @property
    def drafts_in_workers(self) -> bool:
        """Whether the workers draft (MTP, DSpark): their proposals come back with each step's answer."""
        return isinstance(self.drafter, ShippedDrafter)

    @property
    def num_chain_forwards(self) -> int:
        """Drafter forwards every rank runs after a step that samples on some rank, beside the first: MTP's chain
        (max_draft - 1); 0 for DSpark, whose drafter runs no collective, and for prompt lookup."""
        return self.num_draft - 1 if self.drafts_in_workers and self.drafter.is_chained else 0

    def book(self, batch, num_accepted: dict[int, int], seconds: float, drafts: list[Drafts] = ()) -> None:
        """A collected step of `batch`: its items' verified drafts (item index -> accepted), its time and the
        workers' proposals for the next step."""
        self.time_model.record(batch.num_tokens, seconds)
        for i, item in enumerate(batch.items):
            if item.draft_tokens:
                self._record(item.req, len(item.draft_tokens), num_accepted.get(i, 0))
        if self.drafts_in_workers:
            self.drafter.set(drafts)


class ShippedDrafter(Drafter):
    """The engine's view of drafts made in the workers: the proposals of the last collected step."""

    def __init__(self, is_chained: bool):
        self.is_chained = is_chained
        """MTP: the workers' drafts are a chain of forwards of an MoE layer that joins the ranks' collectives."""
        self.proposals: dict[int, Proposal] = {}

    def set(self, drafts: list[Drafts]) -> None:
        self.proposals = {rid: p for d in drafts for rid, p in d.proposals().items()}

    def propose(self, req: Req, k: int) -> Proposal | None:
        proposal = self.proposals.get(req.rid)
        return None if proposal is None else proposal.truncate(k)


def engine_spec_decoder(config: SpeculativeConfig, model_config, batch_invariant: bool) -> EngineSpecDecoder:
    """Prompt lookup, MTP or DSpark, or a drafter object that proposes from the request's tokens alone (no KV
    layers of its own and no `observe` of the target's hidden states, which stay in the workers). Model checks
    run here, before any worker starts."""
    drafter = config.drafter
    if drafter is not None and (drafter.num_kv_layers or type(drafter).observe is not Drafter.observe):
        raise ValueError(f"the drafter {type(drafter).__name__} reads the target model's state, which stays in "
                         "the expert-parallel workers: only drafters proposing from the tokens run there")
    if drafter is None and config.method == "mtp":
        check_has_mtp(model_config)
        drafter = ShippedDrafter(is_chained=True)
    elif drafter is None and config.method == "dspark":
        check_has_dspark(model_config)
        drafter = ShippedDrafter(is_chained=False)
    drafter = drafter or PromptLookupDrafter(config.min_ngram, config.max_ngram)
    return EngineSpecDecoder(config, drafter, batch_invariant, model_config.max_position)


def check_has_dspark(config) -> None:
    """What DSparkDrafter.load refuses, read from the config alone (the engine process holds no model)."""
    if config.architecture != "DeepseekV41ForCausalLM":
        raise ValueError("speculative='dspark' needs a DeepSeek-V4.1 model")
    from deepinfer_rt.env import get_env
    from deepinfer_rt.models.deepseek_v41.config import V41Config
    from deepinfer_rt.speculative.dspark_model import draft_config

    draft_config(V41Config.from_raw({k: v for k, v in config.raw.items() if k != "_tokenizer_dir"}))
    if get_env().v41_yoco_truncation:
        raise ValueError("speculative='dspark' reads target features of every prompt row: turn YOCO prefill "
                         "truncation (DEEPINFER_V41_YOCO_TRUNCATION) off")


class _Verified(Drafter):
    """A prompt-lookup worker proposes nothing: the engine's plan arrives with each step."""

    def propose(self, req: Req, k: int) -> Proposal | None:
        return None


class WorkerMTPDrafter(MTPDrafter):
    """MTP in an EP worker: the in-process drafter, its forwards lined up across ranks (module docstring) and its
    chain's scratch KV in pages the worker keeps back from the engine (`reserve_scratch`)."""

    num_chain_forwards = 0
    """This step's chain forwards every rank runs (StepMsg.draft_forwards)."""

    def scratch_pages(self, max_num_seqs: int, page_size: int) -> int:
        """Pages the chain of a full step needs: (max_draft - 1) positions for each of max_num_seqs requests."""
        return math.ceil(max_num_seqs * max(0, self.max_draft - 1) / page_size)

    def observe(self, runner, batch, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        super().observe(runner, batch, hidden, emitted)
        if not emitted:  # nothing of this rank's drafts: its part in the chain's collectives, empty
            self.run_empty(self.num_chain_forwards, hidden.dtype, hidden.device)

    def _draft(self, runner, ends, x: torch.Tensor) -> dict[int, Proposal]:
        if self.num_chain_forwards != self.max_draft - 1:
            raise RuntimeError(f"the step runs {self.num_chain_forwards} MTP chain forwards on every rank, this "
                               f"rank drafts {self.max_draft} tokens")
        need = math.ceil(len(ends) * (self.max_draft - 1) / runner.pool.page_size)
        if runner.pool.allocator.num_free < need:  # the in-process drafter would draft fewer: not here
            raise RuntimeError(f"MTP chain scratch: {need} pages needed, {runner.pool.allocator.num_free} kept back")
        return super()._draft(runner, ends, x)

    def begin_step(self, draft_forwards: int) -> None:
        """A step arrives: its chain forwards (StepMsg.draft_forwards); the proposals before are verified by now."""
        self.num_chain_forwards = draft_forwards
        self._proposals = {}

    def empty_step(self, dtype: torch.dtype, device: torch.device) -> None:
        """A step without requests of this rank: the MTP forward and its chain, empty."""
        self.run_empty(1 + self.num_chain_forwards, dtype, device)

    def run_empty(self, num_forwards: int, dtype: torch.dtype, device: torch.device) -> None:
        """num_forwards MTP forwards without tokens of this rank: its part in their MoE collectives."""
        for _ in range(num_forwards):
            run_empty(self.mtp, self.mtp.config.hidden_size, dtype, device)

    def drafts(self) -> Drafts:
        return Drafts.pack(self._proposals)


class WorkerDSparkDrafter(DSparkDrafter):
    """DSpark in an EP worker: the in-process drafter over this rank's requests, its draft expert bank whole
    (module docstring), so it has no part in any collective and keeps no scratch pages."""

    def scratch_pages(self, max_num_seqs: int, page_size: int) -> int:
        return 0

    def begin_step(self, draft_forwards: int) -> None:
        if draft_forwards:
            raise RuntimeError(f"the step asks for {draft_forwards} drafter chain forwards: DSpark drafts in one")
        self._proposals = {}

    def empty_step(self, dtype: torch.dtype, device: torch.device) -> None:
        """Nothing: the drafter's MoE is this rank's own."""

    def drafts(self) -> Drafts:
        return Drafts.pack(self._proposals)


WorkerDrafter = WorkerMTPDrafter | WorkerDSparkDrafter
"""The drafters that run in the workers and ship their proposals back (StepReply.drafts)."""


def worker_spec_decoder(config: SpeculativeConfig, batch_invariant: bool, max_position: int, model=None,
                        model_config=None, path=None, load_format: str = "auto", seed: int = 0,
                        make_shard=None) -> SpecDecoder:
    """Prompt lookup: verifies the drafts each step carries. MTP: also drafts, with the layer's MoE sharded as
    the target's (`make_shard()`: this rank's models.loader.Shard). DSpark: also drafts, its expert bank whole."""
    if config.method == "mtp":
        drafter = WorkerMTPDrafter.load(model, model_config, path, load_format, seed, config.num_draft,
                                        make_shard())
    elif config.method == "dspark":
        drafter = WorkerDSparkDrafter.load(model, model_config, path, load_format, seed, config.num_draft)
    else:
        drafter = _Verified()
    return SpecDecoder(config, drafter, batch_invariant, max_position)


def set_step_drafts(spec: SpecDecoder, drafts: dict[int, tuple[list[int], int]]) -> None:
    """The proposals this step verifies (rid -> (draft tokens, req.num_tokens they continue)). Prompt lookup's
    are deterministic: the tokens are all verification reads. MTP's and DSpark's are this worker's own proposals
    of the step before (their draft distributions included), which the engine's plan truncated."""
    if isinstance(spec.drafter, WorkerDrafter):
        own = spec.drafter._proposals
        scheduled = {}
        for rid, (tokens, num_tokens) in drafts.items():
            proposal = own.get(rid)
            if proposal is None or proposal.num_tokens != num_tokens or proposal.tokens[:len(tokens)] != list(tokens):
                raise RuntimeError(f"request {rid}: the step verifies drafts this worker did not propose")
            scheduled[rid] = proposal.truncate(len(tokens))
        spec._scheduled = scheduled
        return
    spec._scheduled = {rid: Proposal(list(tokens), [1.0] * len(tokens), None, num_tokens)
                       for rid, (tokens, num_tokens) in drafts.items()}
