"""Teacher forcing for the DeepInfer-compatible API: a request whose first output tokens are given.

The forced tokens join the prompt, so one prefill feeds them to the model and its prompt logprobs at those
positions are the forced tokens' logprobs (the raw model distribution, as for sampled tokens). Sampling goes on
after them for what is left of max_tokens. A forced EOS (unless ignore_eos) or max_tokens reached inside the
forced tokens ends the request there: the engine then samples one token that is not reported.

    prompt ids            forced (golden) ids        sampled ids
    [0 .. prompt_len)     [prompt_len .. +num_forced)  req.output_ids
    logprobs: prompt_logprobs[1:prompt_len] | prompt_logprobs[prompt_len:] | req.logprobs
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer_rt.request import Req

_UNSUPPORTED_OUTPUT_FIELDS = ("sum_smaller_probs", "nextn_logprobs", "draft_tok", "accept_tok", "confidence_score",
                              "max_num_batched_tokens")


@dataclass
class RequestOutput:
    """One generated token of a request, shaped like DeepInfer's RequestOutput. prompt_logprobs (logprobs of
    prompt tokens 1 .. n-1) ride on a request's first output; `finished` and `finish_reason` on its last."""
    request_id: str
    prompt_len: int
    token_id: int
    finish_reason: str
    finished: bool
    token_logprobs: float
    top_logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    """Why the request failed (finish_reason 'error'); not in DeepInfer's object."""

    def __getattr__(self, name: str):
        if name in _UNSUPPORTED_OUTPUT_FIELDS:
            raise NotImplementedError(f"RequestOutput.{name}: DeepInfer-specific statistic this engine does "
                                      "not compute")
        raise AttributeError(name)


@dataclass
class ForcedRequest:
    req: Req
    prompt_len: int
    forced: list[int]
    forced_finish: str | None
    """'stop' or 'length' when the forced tokens end the output; None when sampling continues after them."""
    params: object
    """The compat SamplingParams (deepinfer_rt.compat.deepinfer)."""

    @classmethod
    def submit(cls, engine, prompt_ids: list[int], params, want_logprobs: bool) -> "ForcedRequest":
        golden = params.golden_token_ids
        if golden is None:
            golden = []
        if not isinstance(golden, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.model_config.vocab_size
                for t in golden):
            raise ValueError(f"golden_token_ids: a list of token ids in [0, {engine.model_config.vocab_size})")
        if golden and params.so_args is not None:
            raise ValueError("golden_token_ids with so_args: the grammar would have to accept the forced tokens "
                             "first; not supported")
        if golden and params.top_logprobs:
            raise ValueError("golden_token_ids with top_logprobs: top logprobs of forced tokens are not "
                             "supported (their own logprobs are)")
        forced, finish = list(golden[: params.max_tokens]), None
        eos = set(engine.eos_ids)
        if not params.ignore_eos:
            for j, token in enumerate(forced):
                if token in eos:
                    forced, finish = forced[: j + 1], "stop"
                    break
        if finish is None and forced and len(forced) >= params.max_tokens:
            finish = "length"
        engine_params = params.to_engine(tuple(engine.eos_ids), len(forced), want_logprobs)
        if forced and not params.prompt_logprobs:
            engine_params.logprob_start_len = len(prompt_ids)  # only the forced positions are computed
        (req,) = engine.add_request(list(prompt_ids) + forced, engine_params)
        return cls(req, len(prompt_ids), forced, finish, params)

    @property
    def finish_reason(self) -> str:
        if self.req.finish_reason == "error" or self.forced_finish is None:
            return self.req.finish_reason or "abort"
        return self.forced_finish

    @property
    def sampled_ids(self) -> list[int]:
        return [] if self.forced_finish is not None and self.req.finish_reason != "error" else self.req.output_ids

    def output_tokens(self) -> list[int]:
        return self.forced + self.sampled_ids

    def outputs(self, request_id: str) -> list[RequestOutput]:
        """DeepInfer's per-token outputs of this request."""
        req, n = self.req, self.prompt_len
        forced_lps = list(req.prompt_logprobs[n:]) if self.forced else []
        sampled = self.sampled_ids
        lps = forced_lps + list(req.logprobs[: len(sampled)])
        tops = [[] for _ in self.forced] + list(req.top_logprobs[: len(sampled)])
        prompt_lps = [v for v in req.prompt_logprobs[1:n]] if self.params.prompt_logprobs else []
        tokens = self.forced + sampled
        if not tokens:  # failed before its first token
            return [RequestOutput(request_id, n, -1, self.finish_reason, True, math.nan, prompt_logprobs=prompt_lps,
                                  error=req.error)]
        outs = []
        for k, token in enumerate(tokens):
            last = k == len(tokens) - 1
            top = tops[k] if k < len(tops) and tops[k] else []
            outs.append(RequestOutput(
                request_id, n, token, self.finish_reason if last else "", last,
                lps[k] if k < len(lps) and lps[k] is not None else math.nan,
                top_logprobs=[v for _, v in top], top_token_ids=[t for t, _ in top], num_output_tokens=k + 1,
                prompt_logprobs=prompt_lps if k == 0 else [], error=req.error if last else None))
        return outs
