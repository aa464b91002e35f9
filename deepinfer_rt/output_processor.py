"""Applies a step's results to requests: sampled tokens, logprobs, detokenization and stop conditions."""
from __future__ import annotations

from deepinfer_rt.request import Req
from deepinfer_rt.tokenizer import IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_position: int):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_position = max_position

    def start(self, req: Req) -> None:
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.stop_strings)
        if req.params.prompt_logprobs:
            req.prompt_logprobs = [None] * max(1, min(req.params.logprob_start_len, req.prompt_len))

    def add_prompt_logprobs(self, req: Req, first: int, values: list[float]) -> None:
        """values[j] is the logprob of prompt token first + j; positions already recorded (a recompute after
        retraction) are kept as they were."""
        for j, v in enumerate(values):
            if first + j == len(req.prompt_logprobs):
                req.prompt_logprobs.append(v)

    def append_token(self, req: Req, token: int, logprob: float | None,
                     top: list[tuple[int, float]] | None) -> bool:
        """Append a sampled token; True when the request is now finished (reason set on req)."""
        p = req.params
        req.token_ids.append(token)
        if p.logprobs or p.top_logprobs:
            req.logprobs.append(logprob)
        if p.top_logprobs:
            req.top_logprobs.append(top)
        if req.grammar is not None and not req.grammar.accept(token):
            self._finish(req, "error")
            req.error = req.grammar.error
            return True
        detok: IncrementalDetokenizer = req.detokenizer
        is_stop_token = token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in self.eos_ids)
        if is_stop_token and req.num_output_tokens > p.min_new_tokens - 1:
            self._finish(req, "stop")
            return True
        if detok.add(token, check_stop=req.num_output_tokens >= p.min_new_tokens):
            req.text = detok.text
            req.finish("stop")
            return True
        if req.grammar is not None and req.grammar.is_terminated():
            self._finish(req, "stop")
            return True
        if req.num_output_tokens >= p.max_new_tokens or req.num_tokens >= self.max_position:
            self._finish(req, "length")
            return True
        req.text = detok.text
        return False

    def _finish(self, req: Req, reason: str) -> None:
        req.detokenizer.flush()
        req.text = req.detokenizer.text
        req.finish(reason)
