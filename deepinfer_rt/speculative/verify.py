"""Exact verification of drafts.

The target scores [last token, d1 .. dk] in one forward: row j is its distribution for the token after d_j,
as if d1 .. dj had already been accepted (penalties, min_new_tokens and the grammar see them: each row is a
`DraftRow`, the request's state with the first j drafts appended). Then, per row j in order:

  greedy                  accept d_{j+1} iff it is the argmax of row j
  point-mass drafts       draw x_j from row j with the sampler's own counter-based noise of that output
                          position; accept d_{j+1} iff x_j == d_{j+1}. A deterministic draft has q = delta(d),
                          so min(1, p/q) = p(d) and the residual is p without d: drawing from p and comparing
                          is the same rule, and it reproduces exactly the tokens of decoding without drafts.
  drafts drawn from q     accept d with probability min(1, p(d)/q(d)); on rejection draw from the residual
                          max(p - q, 0) normalised (Leviathan et al. 2023), so each emitted token follows p.

The first rejected row emits its replacement; when every draft is accepted the last row emits a bonus token.
"""
from __future__ import annotations

import random

import torch

from deepinfer_rt.request import Req
from deepinfer_rt.sampler import filter_logits, gumbel_draw, stream_seed
from deepinfer_rt.speculative.drafter import Proposal

_ACCEPT_SALT = 0x5BD1E9955BD1E995
"""Separates the acceptance uniforms from the sampler's noise stream of the same (seed, position)."""


class DraftRow:
    """Request state seen by the sampler at verification row j: req's tokens plus the first j drafts. Nothing of
    the context is copied: the sampler's penalties read req's device-side counts plus `drafts`."""

    __slots__ = ("req", "drafts", "params", "seed", "grammar", "prompt_len", "num_output_tokens")

    def __init__(self, req: Req, drafts: tuple[int, ...], grammar):
        self.req, self.drafts, self.grammar = req, drafts, grammar
        self.params, self.seed, self.prompt_len = req.params, req.seed, req.prompt_len
        self.num_output_tokens = req.num_output_tokens + len(drafts)


def num_grammar_valid(req: Req, tokens: list[int]) -> int:
    """How many leading drafts req's grammar accepts without terminating (a draft that ends the grammar
    would leave the row after it nothing to mask; verification emits that token itself)."""
    if req.grammar is None:
        return len(tokens)
    matcher = req.grammar.fork().matcher
    for i, token in enumerate(tokens):
        if not matcher.accept_token(token) or matcher.is_terminated():
            return i
    return len(tokens)


def draft_rows(req: Req, drafts: tuple[int, ...] | list[int]) -> list[DraftRow]:
    """Rows 0 .. len(drafts); constrained rows carry the grammar advanced through their drafts."""
    drafts = tuple(drafts)
    grammars = [req.grammar]
    if req.grammar is not None:
        fork = req.grammar.fork()
        for token in drafts:
            fork.accept(token)  # drafts were checked against the grammar when they were scheduled
            grammars.append(fork)
            fork = fork.fork()
    else:
        grammars *= len(drafts) + 1
    return [DraftRow(req, drafts[:j], grammars[j]) for j in range(len(drafts) + 1)]


def verify(logits: torch.Tensor, rows: list[DraftRow], spans: list[tuple[Req, Proposal]]) -> list[list[int]]:
    """logits (R, V): processed rows (Sampler.process) of every item, item after item, len(proposal) + 1 each.
    Returns per item the emitted tokens: accepted drafts, then the replacement or bonus token."""
    scaled = _scaled(logits, rows)
    probs = scaled.softmax(-1) if any(p.probs is not None for _, p in spans) else None
    emitted, row = [], 0
    for req, proposal in spans:
        m = len(proposal.tokens)
        z = scaled[row : row + m + 1]
        if req.params.is_greedy:
            emitted.append(_accept_greedy(z, proposal.tokens))
        elif proposal.probs is None:
            emitted.append(_accept_point_mass(z, proposal.tokens, rows[row : row + m + 1]))
        else:
            emitted.append(_accept_rejection(z, probs[row : row + m + 1], proposal, rows[row : row + m + 1]))
        row += m + 1
    return emitted


def _scaled(logits: torch.Tensor, rows: list[DraftRow]) -> torch.Tensor:
    """Temperature and top-k/p/min-p for sampled rows, exactly as the sampler applies them."""
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not sampled:
        return logits
    out = logits.clone()
    sub = [rows[i] for i in sampled]
    temps = torch.tensor([r.params.temperature for r in sub], device=logits.device)[:, None]
    out[sampled] = filter_logits(logits[sampled] / temps, sub)
    return out


def _accept_greedy(z: torch.Tensor, drafts: list[int]) -> list[int]:
    best = z.argmax(-1).tolist()
    out = []
    for j, d in enumerate(drafts):
        if best[j] != d:
            break
        out.append(d)
    return out + [best[len(out)]]


def _draw(z: torch.Tensor, row: DraftRow) -> int:
    """The sampler's draw for this row's output position (Gumbel-max with its counter-based noise)."""
    return int(gumbel_draw(z[None], [row.seed], [row.num_output_tokens])[0])


def _accept_point_mass(z: torch.Tensor, drafts: list[int], rows: list[DraftRow]) -> list[int]:
    out = []
    for j, d in enumerate(drafts):
        x = _draw(z[j], rows[j])
        if x != d:
            return out + [x]
        out.append(d)
    return out + [_draw(z[len(drafts)], rows[len(drafts)])]


def _accept_rejection(z: torch.Tensor, p: torch.Tensor, proposal: Proposal, rows: list[DraftRow]) -> list[int]:
    q = proposal.probs.to(p.device, p.dtype)
    m = len(proposal.tokens)
    drafts = torch.tensor(proposal.tokens, device=p.device)[:, None]
    p_draft, q_draft = p[:m].gather(1, drafts).squeeze(1).tolist(), q.gather(1, drafts).squeeze(1).tolist()
    out = []
    for j, d in enumerate(proposal.tokens):
        u = random.Random(stream_seed(rows[j].seed ^ _ACCEPT_SALT, rows[j].num_output_tokens)).random()
        if u * q_draft[j] < p_draft[j]:
            out.append(d)
            continue
        residual = (p[j] - q[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is p itself
            residual = p[j]
        return out + [_draw(residual.log(), rows[j])]
    return out + [_draw(z[len(proposal.tokens)], rows[len(proposal.tokens)])]
