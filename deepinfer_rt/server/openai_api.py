"""OpenAI completions and chat completions over the TokenizerManager: request -> (prompt ids, SamplingParams),
and sequence deltas -> response bodies or SSE chunks in OpenAI's shapes."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from deepinfer_rt.server.chat import ChatFormat, RenderedChat, message_text
from deepinfer_rt.server.chat_output import ChatOutputParser, ParsedCall, parse_json_calls
from deepinfer_rt.server.tool_choice import reply_constraint
from deepinfer_rt.server.io_struct import SeqDelta
from deepinfer_rt.server.api_models import ChatCompletionRequest, CompletionRequest
from deepinfer_rt.server.tokenizer_manager import EngineLost, RequestTimeout


def completion_inputs(req: CompletionRequest, encode) -> list[list[int]]:
    """The prompts of a completions request as token ids (text, texts, ids or lists of ids; never empty)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt[0], str):
        return [encode(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer) -> list[str]:
    """The prompts as echo returns them: text as given, token ids decoded (special tokens included)."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if isinstance(req.prompt[0], str):
        return list(req.prompt)
    return [tokenizer.decode(ids) for ids in prompts]


def completion_params(req: CompletionRequest, longest_prompt: int, max_position: int):
    """max_tokens unset: 16, or what the longest prompt leaves of the context. Set: as given (beyond the
    context it is refused, TokenizerManager.check). 0 (echo): one token is generated and dropped, so the
    prompt is scored by the same path as any other request. echo with logprobs: the prompt tokens' logprobs
    with the same count of alternatives."""
    k = req.logprobs
    max_tokens = req.max_tokens if req.max_tokens is not None else min(16, max(1, max_position - longest_prompt))
    params = req.sampling_params(max(1, max_tokens), logprobs=k is not None, top_logprobs=k or 0)
    if req.best_of is not None and req.best_of > req.n:
        params.n, params.logprobs = req.best_of, True  # ranked by their logprobs (collect)
    if req.echo and k is not None:
        params.prompt_logprobs = k if k > 0 else True
    return params


def chat_inputs(req: ChatCompletionRequest, chat: ChatFormat) -> RenderedChat:
    if req.tools and req.tool_choice in (None, "auto") and chat.tool_format is None:
        raise ValueError("tools: this model's tool-call format is not known to the server; use tool_choice "
                         "'required' or a named function (enforced by a constraint), or 'none'")
    messages = []
    for m in req.messages:
        message = m.model_dump(exclude_none=True)
        message["content"] = message_text(m.content)  # text parts joined
        messages.append(message)
    return chat.renderer.render(messages, req.model_dump(exclude_none=True))


def chat_params(req: ChatCompletionRequest, rendered: RenderedChat, max_position: int):
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, max_position - len(rendered.ids))
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise ValueError("top_logprobs: requires logprobs=true")
    params = req.sampling_params(max_tokens, logprobs=req.logprobs, top_logprobs=top)
    fields = reply_constraint(req.model_dump(exclude_none=True), req.constraint_fields(), rendered.starts_in_reasoning)
    params.regex, params.json_schema, params.ebnf = fields.get("regex"), fields.get("json_schema"), fields.get("ebnf")
    return params


@dataclass(frozen=True)
class ChatReading:
    """How a chat reply's text is split into reasoning, content and tool calls."""
    tool_format: str | None
    starts_in_reasoning: bool
    parse_reasoning: bool
    is_forced_call: bool
    """tool_choice 'required' / named: the content is the constrained JSON array of calls."""

    @classmethod
    def of(cls, req: ChatCompletionRequest, chat: ChatFormat, rendered: RenderedChat) -> "ChatReading":
        parse_reasoning = req.separate_reasoning and (chat.is_reasoning_model or rendered.starts_in_reasoning)
        tool_format = chat.tool_format if req.tools and req.tool_choice != "none" else None
        return cls(tool_format, rendered.starts_in_reasoning and parse_reasoning, parse_reasoning,
                   req.tool_choice not in (None, "none", "auto"))

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(None if self.is_forced_call else self.tool_format, self.starts_in_reasoning,
                                self.parse_reasoning)


def _call_body(call: ParsedCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _forced_calls(content: str, finish_reason: str | None) -> list[ParsedCall]:
    """The calls of a forced choice's reply; a reply cut short (length) is not valid JSON and stays content."""
    try:
        return parse_json_calls(content)
    except (ValueError, KeyError, TypeError):
        if finish_reason == "stop":
            raise RuntimeError("the constrained tool-call reply is not a JSON array of calls") from None
        return []


@dataclass
class Choice:
    """One sequence's output, accumulated from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None


class Usage:
    """Token counts over a request's sequences (a prompt counted once, however many samples it has)."""

    def __init__(self, is_output_dropped: bool = False):
        self.prompt = {}
        self.cached = {}
        self.completion = {}
        self.is_output_dropped = is_output_dropped

    def add(self, d: SeqDelta) -> None:
        self.prompt[d.rid] = d.prompt_tokens
        self.cached[d.rid] = d.cached_tokens
        self.completion[(d.rid, d.index)] = 0 if self.is_output_dropped else d.completion_tokens

    def body(self) -> dict:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def check_finish(d: SeqDelta) -> None:
    """A sequence that failed after admission (e.g. its grammar did not compile) fails the response."""
    if d.finish_reason == "error":
        raise RuntimeError(d.error or "generation failed")


@dataclass
class Echo:
    """A completions request's prompts as they come back with echo (one per prompt; choice i is prompt i // n)."""
    texts: list[str]
    token_ids: list[list[int]]
    n: int
    is_output_dropped: bool
    """max_tokens 0: the one token generated to score the prompt is not returned."""

    def of(self, index: int) -> tuple[str, list[int]]:
        return self.texts[index // self.n], self.token_ids[index // self.n]


class Formatter:
    """Builds response bodies and stream chunks for one request ('text_completion' or 'chat.completion')."""

    def __init__(self, kind: str, model: str, tokenizer, echo: Echo | None = None,
                 reading: ChatReading | None = None):
        self.kind = kind
        self.reading = reading
        self._parsers: dict[int, ChatOutputParser] = {}
        self._forced_text: dict[int, str] = {}
        self._num_calls: dict[int, int] = {}
        self.model = model
        self.tokenizer = tokenizer
        self.echo = echo
        self.id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.is_chat = kind == "chat.completion"
        self._roles_sent: set[int] = set()
        self._echoed: set[int] = set()

    @property
    def is_output_dropped(self) -> bool:
        return self.echo is not None and self.echo.is_output_dropped

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top(self, pairs) -> dict[str, float] | None:
        return None if pairs is None else {self._token(t): v for t, v in pairs}

    def logprobs(self, ids: list[int], lps: list[float], tops: list, text_start: int = 0) -> dict | None:
        if not lps:
            return None
        if self.is_chat:
            def entry(tid, lp):
                s = self._token(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            content = []
            for j, (tid, lp) in enumerate(zip(ids, lps)):
                item = entry(tid, lp)
                item["top_logprobs"] = [entry(t, v) for t, v in tops[j]] if tops else []
                content.append(item)
            return {"content": content}
        tokens = [self._token(t) for t in ids]
        offsets, pos = [], text_start
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        top = [self._top(tops[j]) for j in range(len(ids))] if tops else None
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}

    def _completion_choice(self, index: int, c: Choice) -> dict:
        ids, lps, tops = c.token_ids, c.logprobs, c.top_logprobs
        text, has_logprobs = c.text, bool(c.logprobs)
        if self.is_output_dropped:
            ids, lps, tops, text = [], [], [], ""
        if self.echo is not None:
            prompt_text, prompt_ids = self.echo.of(index)
            text = prompt_text + text
            if c.prompt_logprobs is not None:  # echo with logprobs: the prompt's tokens come first
                ids, lps = prompt_ids + ids, list(c.prompt_logprobs) + lps
                if tops or c.prompt_top_logprobs:
                    tops = list(c.prompt_top_logprobs or [None] * len(prompt_ids)) + tops
                has_logprobs = True
        lp = self.logprobs(ids, lps, tops) if has_logprobs else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    def response(self, choices: dict[int, Choice], usage: Usage) -> dict:
        out = []
        for index in sorted(choices):
            c = choices[index]
            if self.is_chat:
                lp = self.logprobs(c.token_ids, c.logprobs, c.top_logprobs)
                out.append({"index": index, "message": self._message(c), "logprobs": lp,
                            "finish_reason": c.finish_reason})
                if out[-1]["message"].get("tool_calls") and c.finish_reason == "stop":
                    out[-1]["finish_reason"] = "tool_calls"
            else:
                out.append(self._completion_choice(index, c))
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": out, "usage": usage.body()}

    def _message(self, c: Choice) -> dict:
        if self.reading is None:
            return {"role": "assistant", "content": c.text}
        parser = self.reading.parser()
        parsed = parser.feed(c.text)
        parsed += parser.finish()
        if self.reading.is_forced_call:
            parsed.tool_calls = _forced_calls(parsed.content, c.finish_reason)
            if parsed.tool_calls:
                parsed.content = ""
        message = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
        if self.reading.parse_reasoning:
            message["reasoning_content"] = parsed.reasoning or None
        if parsed.tool_calls:
            message["tool_calls"] = [_call_body(call) for call in parsed.tool_calls]
        return message

    def _chat_delta(self, d: SeqDelta) -> tuple[dict, str | None]:
        """The delta of one chunk (reasoning_content / content / tool_calls) and its finish reason."""
        if self.reading is None:
            return {"content": d.text}, d.finish_reason
        parser = self._parsers.setdefault(d.index, self.reading.parser())
        parsed = parser.feed(d.text)
        if d.is_finished:
            parsed += parser.finish()
        if self.reading.is_forced_call:  # the JSON array is read whole, once the reply is complete
            self._forced_text[d.index] = self._forced_text.get(d.index, "") + parsed.content
            parsed.content = ""
            if d.is_finished:
                parsed.tool_calls = _forced_calls(self._forced_text[d.index], d.finish_reason)
                if not parsed.tool_calls:
                    parsed.content = self._forced_text[d.index]
        delta = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content or not (parsed.reasoning or parsed.tool_calls):
            delta["content"] = parsed.content
        if parsed.tool_calls:
            first = self._num_calls.get(d.index, 0)
            self._num_calls[d.index] = first + len(parsed.tool_calls)
            delta["tool_calls"] = [{"index": first + j, **_call_body(call)} for j, call in enumerate(parsed.tool_calls)]
        finish = d.finish_reason
        if finish == "stop" and self._num_calls.get(d.index):
            finish = "tool_calls"
        return delta, finish

    def chunk(self, d: SeqDelta, text_start: int) -> dict:
        if self.is_chat:
            lp = self.logprobs(d.token_ids, d.logprobs, d.top_logprobs, text_start)
            delta, finish = self._chat_delta(d)
            if d.index not in self._roles_sent:
                self._roles_sent.add(d.index)
                delta = {"role": "assistant", **delta}
            choice = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            text, lp = d.text, self.logprobs(d.token_ids, d.logprobs, d.top_logprobs, text_start)
            if self.is_output_dropped:
                text, lp = "", None
            if self.echo is not None and d.index not in self._echoed:  # (echo with logprobs does not stream)
                self._echoed.add(d.index)
                text = self.echo.of(d.index)[0] + text
            choice = {"index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}
        return {"id": self.id, "object": self.kind + ".chunk" if self.is_chat else self.kind,
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict:
        return {"id": self.id, "object": self.kind + ".chunk" if self.is_chat else self.kind,
                "created": self.created, "model": self.model, "choices": [], "usage": usage.body()}


@dataclass(frozen=True)
class BestOf:
    """best_of samples were drawn per prompt; n are returned."""
    best_of: int
    n: int
    is_logprobs_asked: bool

    def select(self, choices: dict[int, Choice]) -> dict[int, Choice]:
        """Per prompt, the n samples of highest total logprob (ties: the earlier sample), indexed as n per
        prompt."""
        out = {}
        for p in range(len(choices) // self.best_of):
            samples = [choices[p * self.best_of + k] for k in range(self.best_of)]
            ranked = sorted(range(self.best_of), key=lambda k: -sum(samples[k].logprobs))[: self.n]
            for j, k in enumerate(ranked):
                c = samples[k]
                if not self.is_logprobs_asked:
                    c.logprobs, c.top_logprobs = [], []
                out[p * self.n + j] = c
        return out


async def collect(stream, formatter: Formatter, best_of: BestOf | None = None) -> dict:
    """The whole response of a non-streaming request."""
    choices: dict[int, Choice] = {}
    usage = Usage(formatter.is_output_dropped)
    async for d in stream:
        check_finish(d)
        c = choices.setdefault(d.index, Choice())
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        c.top_logprobs += d.top_logprobs
        c.finish_reason = d.finish_reason or c.finish_reason
        if d.prompt_logprobs is not None:
            c.prompt_logprobs, c.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs
        usage.add(d)
    if best_of is not None:
        choices = best_of.select(choices)
    return formatter.response(choices, usage)


def error_event(e: Exception) -> dict:
    """The error event that ends a stream which cannot finish, in the shape of error responses."""
    code = ("engine_unavailable" if isinstance(e, EngineLost) else "timeout" if isinstance(e, RequestTimeout)
            else None)
    return {"error": {"message": str(e), "type": "invalid_request_error" if isinstance(e, ValueError)
                      else "server_error", "param": None, "code": code}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def stream_events(first: SeqDelta, rest, formatter: Formatter, include_usage: bool):
    """SSE events of a streaming request, starting with its already-received first delta."""
    usage = Usage(formatter.is_output_dropped)
    offsets: dict[int, int] = {}

    def event(d: SeqDelta) -> str:
        check_finish(d)
        usage.add(d)
        start = offsets.get(d.index, 0)
        offsets[d.index] = start + len(d.text)
        return sse(formatter.chunk(d, start))

    try:
        yield event(first)
        async for d in rest:
            yield event(d)
    except (ValueError, RuntimeError) as e:  # rejected, failed in the engine, engine died, timed out
        yield sse(error_event(e))
    if include_usage:
        yield sse(formatter.usage_chunk(usage))
    yield sse("[DONE]")
