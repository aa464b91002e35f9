"""How `select` decides between choices from the logprobs of their tokens.

A method gets, per choice, the logprobs of the choice's tokens after the program's prompt and, if it asks for
them, after a neutral context instead (RuntimeBackend.unconditional_context_ids says what that context is).
It returns a ChoicesDecision: the winning index and one score per choice (reported in the select's meta info,
and the weights select samples with when its temperature is above 0).
"""
from __future__ import annotations

import inspect
import math
import random
from abc import ABC

# Two logprobs closer than this are a tie for greedy_token_selection: the same token after the same prefix,
# scored in different rows of a batch, differs by numerical noise (fp32 ~1e-6, bf16 up to ~1e-2).
_TIE_TOLERANCE = 1e-2


class ChoicesDecision:
    """What a method decided: `index` of the winning choice and one score per choice (our methods), or, as SGLang's
    methods return it, `decision` (the winning choice's text) and `meta_info`. ChoicesDecision(decision="b",
    meta_info={...}) and ChoicesDecision("b", {...}) build the SGLang form; the backend maps it to the index."""

    def __init__(self, index: int | str | None = None, scores: list[float] | dict | None = None,
                 meta_info: dict | None = None, *, decision: str | None = None):
        if isinstance(index, str):  # SGLang's positional form: ChoicesDecision(decision, meta_info)
            index, decision, scores, meta_info = None, index, None, scores if meta_info is None else meta_info
        self.index = index
        self.scores = scores
        self.meta_info = dict(meta_info or {})
        self.decision = decision

    def __repr__(self) -> str:
        return f"ChoicesDecision(index={self.index}, decision={self.decision!r}, scores={self.scores})"


def _logprob(entry) -> float:
    """A token's logprob given as a float or as SGLang's (logprob, token_id, text) entry (None counts as 0)."""
    value = entry[0] if isinstance(entry, (tuple, list)) else entry
    return 0.0 if value is None else float(value)


class ChoicesSamplingMethod(ABC):
    """Base of select's scoring methods. Subclass it either way:

    ours:   decide(token_logprobs, unconditional_token_logprobs) -> ChoicesDecision(index, scores), the lists
            holding float logprobs per choice token;
    SGLang: __call__(*, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=None) -> ChoicesDecision(decision=..., meta_info=...), the token entries
            being (logprob, token_id, text) tuples. The backend sees which one a method overrides
            (`is_sglang_style`) and calls it that way.

    Our methods answer both call forms: method(token_logprobs, unconditional) and SGLang's keyword call (which
    then also sets `decision` to the winning choice)."""

    requires_unconditional_logprobs = False

    def decide(self, token_logprobs: list[list[float]],
               unconditional_token_logprobs: list[list[float]] | None = None) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__}: implement decide() (or SGLang's keyword __call__)")

    def __call__(self, token_logprobs=None, unconditional_token_logprobs=None, *, choices=None,
                 normalized_prompt_logprobs=None, input_token_logprobs=None,
                 output_token_logprobs=None) -> ChoicesDecision:
        """token_logprobs[i][j]: logprob of choice i's token j after the prompt (each list non-empty); entries may
        also be SGLang's (logprob, token_id, text) tuples."""
        if token_logprobs is None:
            token_logprobs = input_token_logprobs
        if token_logprobs is None:
            raise TypeError(f"{self!r}: give the choices' token logprobs")
        conditional = [[_logprob(e) for e in lps] for lps in token_logprobs]
        unconditional = None
        if unconditional_token_logprobs is not None:
            unconditional = [[_logprob(e) for e in lps] for lps in unconditional_token_logprobs]
        decision = self.decide(conditional, unconditional)
        if choices is not None:
            decision.decision = choices[decision.index]
            decision.meta_info.setdefault("normalized_prompt_logprobs", normalized_prompt_logprobs
                                          or [_mean(lps) for lps in conditional])
            decision.meta_info.setdefault("input_token_logprobs", token_logprobs)
            decision.meta_info.setdefault("output_token_logprobs", output_token_logprobs or [[] for _ in choices])
        return decision

    @property
    def is_sglang_style(self) -> bool:
        """Whether the method overrides __call__ with SGLang's keyword signature (`choices=` ...)."""
        call = type(self).__call__
        return call is not ChoicesSamplingMethod.__call__ and "choices" in inspect.signature(call).parameters

    def __repr__(self) -> str:
        return type(self).__name__


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Highest mean token logprob. Can prefer a long choice whose later tokens are near-certain once started."""

    def decide(self, token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        scores = [_mean(lps) for lps in token_logprobs]
        return ChoicesDecision(_argmax(scores), scores)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Highest first-token logprob; ties (within _TIE_TOLERANCE) are broken by the next token, and so on. A
    choice shorter than the others continues with its own mean logprob, so "organ" can still be compared
    with "organism" after their shared first token. Scores are the first-token logprobs."""

    def decide(self, token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(lps) for lps in token_logprobs)
        matrix = [lps + [_mean(lps)] * (width - len(lps)) for lps in token_logprobs]
        remaining = list(range(len(matrix)))
        for col in range(width):
            best = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] >= best - _TIE_TOLERANCE]
            if len(remaining) == 1:
                break
        index = max(remaining, key=lambda i: matrix[i])  # still tied at every column: lexicographic max
        return ChoicesDecision(index, [row[0] for row in matrix], {"greedy_logprob_matrix": matrix})


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Highest mean, over the choice's tokens, of (logprob after the prompt - logprob after a neutral context):
    how much the prompt raises each token above its prior, so a choice is not favoured merely for being a
    common string (EleutherAI, "Multiple Choice Normalization in LM Evaluation"). The neutral context is the
    tokenizer's BOS, if it adds one, and "\n" (RuntimeBackend.unconditional_context_ids); the choice's tokens
    are the same ids in both, scored in the same batched engine call."""

    requires_unconditional_logprobs = True

    def decide(self, token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional token logprobs")
        scores = [_mean([c - u for c, u in zip(cond, uncond, strict=True)])
                  for cond, uncond in zip(token_logprobs, unconditional_token_logprobs, strict=True)]
        return ChoicesDecision(_argmax(scores), scores)


def sample_index(scores: list[float], temperature: float, rng: random.Random) -> int:
    """A choice index drawn with probability proportional to exp(score / temperature)."""
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return rng.choices(range(len(scores)), weights=weights)[0]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
