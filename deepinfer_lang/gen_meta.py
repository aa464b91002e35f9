"""What a gen reports back to the program: its finish reason (read as a string or as SGLang's dict) and the
meta info of SGLang's get_meta_info (token counts, latency, logprob entries)."""
from __future__ import annotations

import uuid

from deepinfer_lang.backend import RuntimeBackend
from deepinfer_lang.ir import GenArgs
from deepinfer_rt import GenerateOutput


class UnknownVariableError(KeyError):
    """A variable read that no expression has set (a KeyError, printed without KeyError's quoting)."""

    def __str__(self) -> str:
        return self.args[0]


class FinishReason(str):
    """A gen's finish reason: compares and prints as our string ('stop', 'length', 'abort', 'error') and reads as
    SGLang's dict too: reason["type"], reason["matched"] (the stop token id, when a stop token ended it),
    reason["length"] (max_new_tokens, when the length did)."""

    def __new__(cls, reason: str, **info):
        obj = super().__new__(cls, reason)
        obj.info = {"type": reason, **info}
        return obj

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.info[key]
        return str.__getitem__(self, key)

    def get(self, key: str, default=None):
        return self.info.get(key, default)

    def keys(self):
        return self.info.keys()


def finish_reason(out: GenerateOutput, params, backend: RuntimeBackend) -> FinishReason:
    if out.finish_reason == "length":
        return FinishReason("length", length=params.max_new_tokens)
    if out.finish_reason == "stop":
        stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(backend.eos_ids))
        last = out.token_ids[-1] if out.token_ids else None
        return FinishReason("stop", matched=last if last in stop_ids else None)
    return FinishReason(out.finish_reason, message=out.error)


def gen_meta(out: GenerateOutput, prompt: list[int], params, args: GenArgs, backend: RuntimeBackend,
              latency: float) -> dict:
    """SGLang's meta info of a gen: id, finish_reason, token counts, e2e_latency and, when asked for, logprobs as
    (logprob, token_id, token_text) entries (the text with return_text_in_logprobs, else None)."""
    with_text = bool(args.return_text_in_logprobs)

    def entry(lp, tid):
        return (lp, tid, backend.tokenizer.decode([tid]) if with_text else None)

    meta = {"id": uuid.uuid4().hex, "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens, "finish_reason": finish_reason(out, params, backend),
            "e2e_latency": latency}
    if out.logprobs is not None:
        meta["output_token_logprobs"] = [entry(lp, tid) for lp, tid in zip(out.logprobs, out.token_ids)]
    if out.top_logprobs is not None:
        meta["output_top_logprobs"] = [[entry(lp, tid) for tid, lp in top] for top in out.top_logprobs]
    if out.prompt_logprobs is not None:
        start = params.logprob_start_len
        meta["input_token_logprobs"] = [entry(out.prompt_logprobs[i], prompt[i]) for i in range(start, len(prompt))]
    return meta
