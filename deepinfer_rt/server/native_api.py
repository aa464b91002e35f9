"""Native /generate: text or token ids with our full SamplingParams; outputs carry GenerateOutput's fields
(text, output_ids, and under meta_info: finish_reason, error, token counts, logprobs)."""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.server.io_struct import SeqDelta
from deepinfer_rt.server.api_models import GenerateRequest
from deepinfer_rt.server.tokenizer_manager import Overloaded, TokenizerManager


def inputs(body: GenerateRequest, encode) -> list[tuple[list[int], SamplingParams]]:
    if (body.text is None) == (body.input_ids is None):
        raise ValueError("text/input_ids: give exactly one of them")
    if body.text is not None:
        id_lists = [encode(t) for t in ([body.text] if isinstance(body.text, str) else body.text)]
    else:
        ids = body.input_ids
        id_lists = [list(ids)] if ids and isinstance(ids[0], int) else [list(x) for x in ids]
    if not id_lists:
        raise ValueError("input_ids: no inputs")
    raw = body.sampling_params
    if isinstance(raw, list):
        if len(raw) != len(id_lists):
            raise ValueError(f"sampling_params: {len(raw)} given for {len(id_lists)} inputs")
        params = [_params(p) for p in raw]
    else:
        params = [_params(raw or {})] * len(id_lists)
    return list(zip(id_lists, params))


def _params(fields: dict) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except TypeError as e:  # an unknown field name
        raise ValueError(f"sampling_params: {e}") from None


def is_single(body: GenerateRequest) -> bool:
    return isinstance(body.text, str) or (bool(body.input_ids) and isinstance(body.input_ids[0], int))


def _submit_all(tm: TokenizerManager, inputs):
    streams = []
    try:
        for ids, params in inputs:
            streams.append(tm.submit([ids], params))
    except Overloaded:
        for s in streams:
            s.close()
        raise
    return streams


async def _collect_one(stream, params: SamplingParams) -> list[dict]:
    outs = [{"text": "", "output_ids": [], "meta_info": {}} for _ in range(params.n)]
    try:
        async for d in stream:
            out = outs[d.index]
            out["text"] += d.text
            out["output_ids"] += d.token_ids
            meta = out["meta_info"]
            meta.setdefault("logprobs", []).extend(d.logprobs)
            meta.setdefault("top_logprobs", []).extend(d.top_logprobs)
            if d.is_finished:
                meta.update(_final_meta(d, params))
    finally:
        stream.close()
    return outs


def _final_meta(d: SeqDelta, params: SamplingParams) -> dict:
    return {"finish_reason": d.finish_reason, "error": d.error, "prompt_tokens": d.prompt_tokens,
            "completion_tokens": d.completion_tokens, "cached_tokens": d.cached_tokens,
            "prompt_logprobs": d.prompt_logprobs}


async def generate(tm: TokenizerManager, inputs) -> list[dict]:
    """All outputs, grouped per input in input order (n per input), as Engine.generate orders them."""
    streams = _submit_all(tm, inputs)
    results = []
    try:
        for stream, (_, params) in zip(streams, inputs):
            for out in await _collect_one(stream, params):
                meta = out["meta_info"]
                if not (params.logprobs or params.top_logprobs):
                    meta["logprobs"] = None
                if not params.top_logprobs:
                    meta["top_logprobs"] = None
                results.append(out)
    finally:
        for s in streams:
            s.close()
    return results


async def stream(request, tm: TokenizerManager, inputs, wait):
    """SSE of text deltas of a single input (n = 1): {"text", "output_ids", "meta_info"} then [DONE]."""
    if len(inputs) != 1 or inputs[0][1].n != 1:
        raise ValueError("stream: streams one input with n=1")
    (ids, params), = inputs
    req_stream = tm.submit([ids], params)
    it = req_stream.__aiter__()
    try:
        first = await wait(request, it.__anext__())
    except BaseException:
        req_stream.close()
        raise

    def event(d: SeqDelta) -> str:
        meta = _final_meta(d, params) if d.is_finished else {}
        return f"data: {json.dumps({'text': d.text, 'output_ids': d.token_ids, 'meta_info': meta})}\n\n"

    async def events():
        try:
            yield event(first)
            async for d in it:
                yield event(d)
            yield "data: [DONE]\n\n"
        finally:
            req_stream.close()

    return StreamingResponse(events(), media_type="text/event-stream")
