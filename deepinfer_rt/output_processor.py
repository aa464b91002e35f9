"""Applies a step's results to requests: sampled tokens, logprobs, detokenization and stop conditions."""
from __future__ import annotations

import logging

from deepinfer_rt.request import Req
from deepinfer_rt.tokenizer import IncrementalDetokenizer, batch_decoder


logger = logging.getLogger("deepinfer_rt")


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_position: int):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_position = max_position
        self._decode_batch = batch_decoder(tokenizer)

    def start(self, req: Req) -> None:
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.stop_strings)
        if req.params.prompt_logprobs:
            req.prompt_logprobs = [None] * max(1, min(req.params.logprob_start_len, req.prompt_len))
            if req.params.num_prompt_top_logprobs:
                req.prompt_top_logprobs = [None] * len(req.prompt_logprobs)

    def add_prompt_logprobs(self, req: Req, first: int, values: list[float],
                            tops: list[list[tuple[int, float]]] | None = None) -> None:
        """values[j] is the logprob of prompt token first + j (tops[j] its position's top tokens, when asked);
        positions already recorded (a recompute after retraction) are kept as they were."""
        for j, v in enumerate(values):
            if first + j == len(req.prompt_logprobs):
                req.prompt_logprobs.append(v)
                if tops is not None:
                    req.prompt_top_logprobs.append(tops[j])

    def append_token(self, req: Req, token: int, logprob: float | None,
                     top: list[tuple[int, float]] | None) -> bool:
        """Append a sampled token; True when the request is now finished (reason set on req; 'error' if applying
        the token raised)."""
        return self._guarded(req, self._append_one, req, token, logprob, top)

    def _append_one(self, req: Req, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> bool:
        if self._append(req, token, logprob, top):
            return True
        if req.detokenizer.is_lazy:
            req.detokenizer.queue(token)
            return self._after_text(req, False)
        stopped = req.detokenizer.add(token, check_stop=req.num_output_tokens >= req.params.min_new_tokens)
        return self._after_text(req, stopped)

    def append_tokens(self, reqs: list[Req], tokens: list[int]) -> list[bool]:
        """`append_token(req, token, None, None)` for each request (each at most once), with the detokenizer
        windows of all of them decoded in two batched tokenizer calls instead of two calls per request. A
        request whose token cannot be applied (an exception in its grammar or text) finishes alone with an
        error; the batched decode falls back to one request at a time if it fails."""
        done, windows = [], {}
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            try:
                is_done = self._append(req, token, None, None)
                if not is_done:
                    if req.detokenizer.is_lazy:  # no stop string: its text is decoded when read
                        req.detokenizer.queue(token)
                        is_done = self._after_text(req, False)
                    else:
                        windows[i] = req.detokenizer.push(token)
            except Exception as e:  # noqa: BLE001 -- that request fails, the others go on
                is_done = self._fail(req, e)
            done.append(is_done)
        live = list(windows)
        if not live:
            return done
        try:
            prefixes = self._decode_batch([windows[i][0] for i in live])
            texts = self._decode_batch([windows[i][1] for i in live])
        except Exception:  # noqa: BLE001 -- decoded one by one below, so only a failing request fails
            prefixes = [self._guarded(reqs[i], lambda w: self._decode_batch([w])[0], windows[i][0]) for i in live]
            texts = [self._guarded(reqs[i], lambda w: self._decode_batch([w])[0], windows[i][1]) for i in live]
        for i, prefix, text in zip(live, prefixes, texts):
            req = reqs[i]
            if req.is_finished:
                done[i] = True
                continue
            try:
                done[i] = self._after_text(req, req.detokenizer.commit(
                    prefix, text, req.num_output_tokens >= req.params.min_new_tokens))
            except Exception as e:  # noqa: BLE001
                done[i] = self._fail(req, e)
        return done

    @staticmethod
    def _fail(req: Req, error: Exception) -> bool:
        logger.exception("request %d: failed to apply its token", req.rid)
        req.finish("error", f"failed to apply a sampled token: {type(error).__name__}: {error}")
        return True

    @classmethod
    def _guarded(cls, req: Req, fn, *args):
        """fn(*args); if it raises, the request finishes with an error (returns True, as 'finished')."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 -- that request fails, the others go on
            return cls._fail(req, e)

    def _append(self, req: Req, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> bool:
        """The token and its logprobs, then the checks that come before its text (grammar, stop tokens);
        True when they finished the request."""
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
        is_stop_token = token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in self.eos_ids)
        if is_stop_token and req.num_output_tokens > p.min_new_tokens - 1:
            self._finish(req, "stop")
            return True
        return False

    def _after_text(self, req: Req, stopped: bool) -> bool:
        """The checks after the token's text: a stop string (`stopped`), grammar end, length limits."""
        detok: IncrementalDetokenizer = req.detokenizer
        if stopped:
            req.text = detok.text
            req.finish("stop")
            return True
        if req.grammar is not None and req.grammar.is_terminated():
            self._finish(req, "stop")
            return True
        if req.num_output_tokens >= req.params.max_new_tokens or req.num_tokens >= self.max_position:
            self._finish(req, "length")
            return True
        if not detok.is_lazy:
            req.text = detok.text
        return False

    def _finish(self, req: Req, reason: str) -> None:
        req.detokenizer.flush()
        req.text = req.detokenizer.text
        req.finish(reason)
