"""Request bodies of the HTTP API (pydantic): OpenAI's completions and chat completions, plus our extensions
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, regex, ebnf) and the native
/generate. A body that does not validate is answered 400 naming the field (http_server's handler)."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepinfer_rt.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """Fields common to completions and chat completions."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    user: str | None = None
    # extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def constraint_fields(self) -> dict:
        """regex / json_schema / ebnf for SamplingParams (at most one: SamplingParams.validate says so)."""
        fields = {"regex": self.regex, "ebnf": self.ebnf}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            fields["json_schema"] = {"type": "object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format.json_schema: required when type is 'json_schema'")
            fields["json_schema"] = json.dumps(fmt.json_schema.schema_)
        return fields

    def sampling_params(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, n=self.n, seed=self.seed,
            logprobs=logprobs, top_logprobs=top_logprobs, **self.constraint_fields())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(BaseModel):
    """Native /generate: text or token ids (one or a batch) with our full SamplingParams (one or one per
    input, as Engine.generate takes them)."""
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
