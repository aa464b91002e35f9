"""SpecDecoder: what the scheduler, the model runner and the engine call when speculation is on.

    scheduler   plan(reqs, base_tokens, budget) -> drafts per decoding request (confidence-scheduled)
    runner      verify(...) on the rows of items that carry drafts -> emitted tokens, accepted counts
                observe(...) after every forward: step time for the planner, the drafter's own update
    engine      kv_layout(...) (pool layers the drafter needs), stats()

The scheduler rolls back the KV of rejected positions (Scheduler.update): a request's computed length grows
by 1 + accepted, and pages beyond it are freed, so the prefix cache only ever sees verified tokens.
"""
from __future__ import annotations

import torch

from deepinfer_rt.cache.kv_pool import KVLayout
from deepinfer_rt.request import Req
from deepinfer_rt.speculative.config import SpeculativeConfig
from deepinfer_rt.speculative.drafter import Drafter, PromptLookupDrafter, Proposal
from deepinfer_rt.speculative.planner import StepTimeModel, plan_drafts
from deepinfer_rt.speculative.stats import spec_stats
from deepinfer_rt.speculative.verify import draft_rows, num_grammar_valid, verify


_FORCED_CONFIDENCE = 0.9
"""Confidence of grammar-forced drafts: the text is certain, the target's tokenization of it nearly so."""


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, batch_invariant: bool, max_position: int):
        self.config = config
        self.drafter = drafter
        self.num_draft = config.num_draft
        self.fixed_length = batch_invariant if config.fixed_length is None else config.fixed_length
        self.max_position = max_position
        self.time_model = StepTimeModel()
        self._scheduled: dict[int, Proposal] = {}
        self.num_drafted = self.num_accepted = self.num_verify_steps = 0

    def kv_layout(self, layout: KVLayout) -> KVLayout:
        return self.drafter.kv_layout(layout)

    # ---- scheduler ----
    def plan(self, reqs: list[Req], base_tokens: int, budget: int) -> list[list[int]]:
        """Draft tokens each decoding request verifies this step (possibly none)."""
        proposals = [self._proposal(r) for r in reqs]
        counts = plan_drafts([p.confidences if p else [] for p in proposals], base_tokens, budget,
                             self.time_model, self.fixed_length)
        self._scheduled = {}
        drafts = []
        for req, proposal, m in zip(reqs, proposals, counts):
            if m:
                self._scheduled[req.rid] = proposal.truncate(m)
            drafts.append(proposal.tokens[:m] if m else [])
        return drafts

    def _proposal(self, req: Req) -> Proposal | None:
        p = req.params
        if p.logprobs or p.top_logprobs:
            return None  # logprobs are reported per sampled row; such requests decode one token a step
        # The bonus token always comes on top; positions must stay inside the context.
        k = min(self.num_draft, p.max_new_tokens - req.num_output_tokens - 1,
                self.max_position - req.num_tokens - 1)
        if k <= 0:
            return None
        proposal = self.drafter.propose(req, k)
        if proposal is not None and proposal.num_tokens == req.num_tokens:
            proposal = proposal.truncate(min(k, num_grammar_valid(req, proposal.tokens)))
        else:
            proposal = None
        if req.grammar is not None and (proposal is None or len(proposal.tokens) < k):
            # Where the grammar forces the text (JSON keys, literals), its tokens are drafts too.
            forced = req.grammar.matcher.find_jump_forward_tokens()[:k]
            if forced and (proposal is None or len(forced) > len(proposal.tokens)):
                proposal = Proposal(forced, [_FORCED_CONFIDENCE] * len(forced), None, req.num_tokens)
        return proposal if proposal is not None and proposal.tokens else None

    # ---- model runner ----
    @torch.no_grad()
    def verify(self, runner, batch, hidden: torch.Tensor, spec_rows: dict[int, int]
               ) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """spec_rows: item index -> first row of its [last token, drafts] in hidden. Returns (item, token)
        for every emitted token, in order, and item index -> drafts accepted."""
        if not spec_rows:
            return [], {}
        row_ids, rows, spans = [], [], []
        for i, start in spec_rows.items():
            item = batch.items[i]
            proposal = self._scheduled[item.req.rid].truncate(len(item.draft_tokens))
            row_ids.extend(range(start, start + len(item.draft_tokens) + 1))
            rows.extend(draft_rows(item.req, item.draft_tokens))
            spans.append((item.req, proposal))
        logits = runner.model.compute_logits(hidden[row_ids])[:, : runner.sampler.vocab_size].float()
        bitmask_fn = None
        if any(r.grammar is not None for r in rows):
            grammars = [r.grammar for r in rows]
            bitmask_fn = lambda z: runner.grammar.fill_and_apply(z, grammars)  # noqa: E731
        processed = runner.sampler.process(logits, rows, runner.eos_ids, bitmask_fn)
        out, accepted = [], {}
        for i, tokens in zip(spec_rows, verify(processed, rows, spans)):
            item = batch.items[i]
            accepted[i] = len(tokens) - 1
            self._record(item.req, len(item.draft_tokens), accepted[i])
            out.extend((i, t) for t in tokens)
        return out, accepted

    def observe(self, runner, batch, hidden: torch.Tensor, sampled: list[tuple[int, int]], seconds: float
                ) -> None:
        self.time_model.record(batch.num_tokens, seconds)
        emitted: dict[int, list[int]] = {}
        for i, token in sampled:
            emitted.setdefault(i, []).append(token)
        self.drafter.observe(runner, batch, hidden, emitted)

    def _record(self, req: Req, num_drafted: int, num_accepted: int) -> None:
        req.num_draft_tokens += num_drafted
        req.num_accepted_tokens += num_accepted
        req.num_spec_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_verify_steps += 1

    # ---- engine ----
    def stats(self) -> dict:
        return spec_stats(self.num_drafted, self.num_accepted, self.num_verify_steps)


def build_spec_decoder(config: SpeculativeConfig, model, model_config, path, load_format: str,
                       batch_invariant: bool, seed: int) -> SpecDecoder:
    if config.drafter is not None:
        drafter = config.drafter
    elif config.method == "prompt_lookup":
        from deepinfer_rt.speculative.grammar_draft import GrammarDrafter
        from deepinfer_rt.tokenizer import load_tokenizer

        # Constrained requests draft the grammar's text too (tokenized as the engine's tokenizer does).
        drafter = GrammarDrafter(load_tokenizer(path), PromptLookupDrafter(config.min_ngram, config.max_ngram))
    elif config.method == "dspark":
        from deepinfer_rt.speculative.dspark import DSparkDrafter

        drafter = DSparkDrafter.load(model, model_config, path, load_format, seed, config.num_draft)
    else:
        from deepinfer_rt.speculative.mtp import MTPDrafter

        drafter = MTPDrafter.load(model, model_config, path, load_format, seed, config.num_draft)
    return SpecDecoder(config, drafter, batch_invariant, model_config.max_position)
