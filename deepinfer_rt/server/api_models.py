"""Request and response bodies of the HTTP API (pydantic): OpenAI's completions and chat completions, plus our
extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, regex, ebnf) and the native
/generate.

Request models are strict: an unknown field is refused (extra="forbid": nothing is silently ignored), a field
takes only its JSON type (no "16" for an int, no true for an int, no "no" for a bool), floats are finite,
integers bounded, text is limited (env.py). A body that does not validate is answered
400 naming the field, in OpenAI's error shape (ErrorResponse; http_server's handler). Response models document
/openapi.json; the routes build their bodies as plain dicts of these shapes.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepinfer_rt.env import get_env
from deepinfer_rt.sampling_params import MAX_INT, MAX_STOP_STRINGS, SEED_RANGE, SamplingParams

_ENV = get_env()
_STRICT = dict(strict=True, allow_inf_nan=False)

MAX_LOGIT_BIAS = 4096
MAX_N = 128
"""Samples per prompt over HTTP (SamplingParams allows more offline)."""
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
"""Checked against the model's vocabulary once it is known (the routes)."""
PromptText = Annotated[str, Field(max_length=_ENV.max_prompt_chars)]
GrammarText = Annotated[str, Field(max_length=_ENV.max_grammar_chars)]
ShortText = Annotated[str, Field(max_length=4096)]
Count = Annotated[int, Field(ge=1, le=MAX_INT)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(max_length=MAX_STOP_STRINGS)]
StopIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(**_STRICT, populate_by_name=True, extra="forbid")
    name: ShortText = "schema"
    description: PromptText | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """Fields common to completions and chat completions. A field the server does not implement is refused
    (400 naming it), never silently dropped."""
    model_config = ConfigDict(**_STRICT, extra="forbid", populate_by_name=True)

    model: ShortText
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[str, Field(min_length=1, max_length=4096)] | StopList | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    """Token id (as a JSON key) -> bias added to its logit."""
    user: ShortText | None = None
    """OpenAI's end-user id: accepted for compatibility; it does not change the output."""
    # extensions
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    ignore_eos: bool = False
    stop_token_ids: StopIds | None = None
    regex: GrammarText | None = None
    ebnf: GrammarText | None = None

    def constraint_fields(self) -> dict:
        """regex / json_schema / ebnf for SamplingParams (at most one: SamplingParams.validate says so)."""
        fields = {"regex": self.regex, "ebnf": self.ebnf}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            fields["json_schema"] = {"type": "object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format.json_schema: required when type is 'json_schema'")
            # The body's depth was bounded before parsing (http_server), so this cannot recurse too deep.
            fields["json_schema"] = json.dumps(fmt.json_schema.schema_)
        return fields

    def token_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_INT:
                raise ValueError(f"logit_bias: keys must be token ids, got {key[:40]!r}")
            bias[int(key)] = float(value)
        return bias

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(logit_bias=self.token_bias(),
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, n=self.n, seed=self.seed,
            logprobs=logprobs, top_logprobs=top_logprobs, **self.constraint_fields())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: (PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_N)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_N)])
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] | None = None
    """None: 16, or what is left of the context if that is less. 0 (with echo): score the prompt only."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Logprobs of the output tokens (and with echo of the prompt tokens) with this many alternatives each."""
    echo: bool = False
    """The prompt comes back before the completion, in the text and (with logprobs) in the logprobs."""
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """Samples drawn per prompt; the n with the highest total logprob are returned (not with stream)."""
    suffix: ShortText | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value

    @model_validator(mode="after")
    def _check_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo (scoring the prompt)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of: must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: more samples than n cannot be streamed (they are ranked once complete)")
        if self.echo and self.stream and self.logprobs is not None:
            raise ValueError("logprobs: with echo, prompt logprobs are returned only when stream is false")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    type: Literal["text"]
    text: PromptText


class FunctionCall(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    name: ShortText
    arguments: PromptText
    """JSON text, as the model wrote it."""


class ToolCall(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    id: ShortText
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: PromptText | Annotated[list[TextPart], Field(max_length=1024)] | None = None
    name: ShortText | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=1024)] | None = None
    """An assistant turn's calls (its content may be empty)."""
    tool_call_id: ShortText | None = None
    """A tool turn: the call it answers."""
    reasoning_content: PromptText | None = None
    """An assistant turn's reasoning (templates of thinking models drop or keep it)."""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: PromptText | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object."""
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    name: ShortText


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(**_STRICT, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(max_length=1024)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: 'auto' with tools, else 'none'. 'required' and a named function are enforced by a JSON-schema
    constraint on the calls."""
    parallel_tool_calls: bool = True
    """False: at most one call (enforced with 'required' or a named function; with 'auto', later calls are
    dropped)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """Thinking models: 'none' turns thinking off; the others on (DeepSeek-V4 renders high and max)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Passed to the chat template (e.g. {"thinking": true} or {"enable_thinking": false})."""
    separate_reasoning: bool = True
    """Thinking models: reasoning comes back as reasoning_content (False: left in content)."""

    @model_validator(mode="after")
    def _check_tools(self):
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) or choice == "required":
            names = {t.function.name for t in self.tools or ()}
            if not names:
                raise ValueError("tool_choice: requires tools")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("response_format: cannot be combined with a required tool call")
        return self


class GenerateSamplingParams(BaseModel):
    """SamplingParams over HTTP: the same fields and bounds, strictly typed; unknown fields are refused."""
    model_config = ConfigDict(**_STRICT, extra="forbid")

    max_new_tokens: Count = 128
    min_new_tokens: int = Field(0, ge=0, le=MAX_INT)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: Annotated[str, Field(min_length=1, max_length=4096)] | StopList | None = None
    stop_token_ids: StopIds | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Seed | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    prompt_logprobs: bool | Annotated[int, Field(ge=0, le=20)] = False
    logprob_start_len: int = Field(0, ge=0, le=MAX_INT)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    """Token id (as a JSON key) -> bias in [-100, 100] added to its logit."""
    regex: GrammarText | None = None
    json_schema: GrammarText | dict[str, Any] | bool | None = None
    ebnf: GrammarText | None = None

    def to_sampling_params(self) -> SamplingParams:
        fields = self.model_dump(exclude_unset=True)
        if fields.get("logit_bias") is not None:
            bad = [k for k in fields["logit_bias"] if not (k.isascii() and k.isdigit()) or int(k) > MAX_INT]
            if bad:
                raise ValueError(f"logit_bias: keys must be token ids, got {bad[0][:40]!r}")
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        return SamplingParams(**fields)


class GenerateRequest(BaseModel):
    """Native /generate: text or token ids (one or a batch) with our full SamplingParams (one or one per
    input, as Engine.generate takes them)."""
    model_config = ConfigDict(**_STRICT, extra="forbid")

    text: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_N)] | None = None
    input_ids: (Annotated[list[TokenId], Field(min_length=1)]
                | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_N)]
                | None) = None
    sampling_params: (GenerateSamplingParams | Annotated[list[GenerateSamplingParams], Field(max_length=MAX_N)]
                      | None) = None
    stream: bool = False


# ---- responses (documentation of /openapi.json) ----
class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    """The request field at fault, by its public name (messages[0].content, max_tokens, ...)."""
    code: str | None
    """Machine-readable reason when there is one: json_invalid, body_too_large, model_not_found, overloaded,
    engine_unavailable, timeout, ..."""


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(BaseModel):
    """Also the shape of each SSE chunk (object 'text_completion') when stream is true."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    """None when the turn is only tool calls."""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    """With stream true: SSE chunks of object 'chat.completion.chunk' whose choices carry a delta."""
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class GenerateMeta(BaseModel):
    finish_reason: Literal["stop", "length", "abort"] | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With a prompt_logprobs count k: the k most likely (token id, logprob) at each prompt position."""


class GenerateOutput(BaseModel):
    """One sequence; /generate answers a list of them (n per input, in input order), or with stream true SSE
    events of this shape (text deltas) ending with `data: [DONE]`."""
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
