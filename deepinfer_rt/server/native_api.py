"""Native /generate: text or token ids with our full SamplingParams; outputs carry GenerateOutput's fields
(text, output_ids, and under meta_info: finish_reason, error, token counts, logprobs)."""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.server.io_struct import SeqDelta
from deepinfer_rt.server.api_models import GenerateRequest
from deepinfer_rt.server import openai_api
from deepinfer_rt.server.tokenizer_manager import TokenizerManager


def inputs(body: GenerateRequest, encode) -> list[tuple[list[int], SamplingParams]]:
    if (body.text is None) == (body.input_ids is None):
        raise ValueError("text/input_ids: give exactly one of them")
    if body.text is not None:
        id_lists = [encode(t) for t in ([body.text] if isinstance(body.text, str) else body.text)]
    else:
        ids = body.input_ids
        id_lists = [list(ids)] if isinstance(ids[0], int) else [list(x) for x in ids]
    raw = body.sampling_params
    if isinstance(raw, list):
        if len(raw) != len(id_lists):
            raise ValueError(f"sampling_params: {len(raw)} given for {len(id_lists)} inputs")
        params = [p.to_sampling_params() for p in raw]
    else:
        params = [raw.to_sampling_params() if raw is not None else SamplingParams()] * len(id_lists)
    return list(zip(id_lists, params))


def _submit_all(tm: TokenizerManager, inputs):
    """One stream per input; if any is refused, those already admitted are closed (nothing stays counted)."""
    streams = []
    try:
        for i, (ids, params) in enumerate(inputs):
            streams.append(tm.submit([ids], params, first_index=i))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def _collect_one(stream, params: SamplingParams) -> list[dict]:
    outs = [{"text": "", "output_ids": [], "meta_info": {}} for _ in range(params.n)]
    try:
        async for d in stream:
            if d.finish_reason == "error":  # the generation failed in the engine: the request fails (500)
                raise RuntimeError(d.error or "generation failed")
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
            "prompt_logprobs": d.prompt_logprobs, "prompt_top_logprobs": d.prompt_top_logprobs}


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
        if first.finish_reason == "error":
            raise RuntimeError(first.error or "generation failed")
    except BaseException:
        req_stream.close()
        raise

    def event(d: SeqDelta) -> str:
        if d.finish_reason == "error":
            raise RuntimeError(d.error or "generation failed")
        meta = _final_meta(d, params) if d.is_finished else {}
        return f"data: {json.dumps({'text': d.text, 'output_ids': d.token_ids, 'meta_info': meta})}\n\n"

    async def events():
        try:
            yield event(first)
            async for d in it:
                yield event(d)
        except (ValueError, RuntimeError) as e:  # the engine failed or died, or the request timed out
            yield openai_api.sse(openai_api.error_event(e))
        finally:
            req_stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
