"""sglang.lang.ir: the expression nodes under SGLang's names, and the regexes gen(dtype=...) constrains with.

SglExpr, SglExprList, SglConstantText, SglSelect, SglRoleBegin/End, SglVarScopeBegin/End, SglSeparateReasoning,
SglImage, SglVideo are our node classes. SglGen takes SGLang's positional arguments and builds our Gen;
SglFunction is our Program; SglSamplingParams is SGLang's sampling record (to_srt_kwargs for a server)."""
from __future__ import annotations

import dataclasses

from deepinfer_lang.api import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, Program, gen  # noqa: F401
from deepinfer_lang.ir import (  # noqa: F401
    Expr,
    ExprList,
    Gen,
    GenArgs,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    Video,
)

SglExpr = Expr
SglExprList = ExprList
SglConstantText = Text
SglSelect = Select
SglRoleBegin = RoleBegin
SglRoleEnd = RoleEnd
SglVarScopeBegin = VarScopeBegin
SglVarScopeEnd = VarScopeEnd
SglSeparateReasoning = SeparateReasoning
SglImage = Image
SglVideo = Video
SglFunction = Program


def SglGen(name=None, max_new_tokens=None, min_new_tokens=None, n=None, stop=None, stop_token_ids=None,
           stop_regex=None, temperature=None, top_p=None, top_k=None, min_p=None, frequency_penalty=None,
           presence_penalty=None, ignore_eos=None, return_logprob=None, logprob_start_len=None,
           top_logprobs_num=None, return_text_in_logprobs=None, dtype=None, regex=None, json_schema=None) -> Gen:
    """A Gen node from SGLang's SglGen arguments (in its order); isinstance checks use Gen (= gen's nodes)."""
    return gen(name, max_new_tokens, min_new_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k,
               min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, dtype, None, None, regex, json_schema)


@dataclasses.dataclass
class SglSamplingParams:
    """SGLang's sampling record (run()'s defaults and a gen's overrides, merged)."""
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: str | list[str] = ()
    stop_token_ids: list[int] | None = ()
    stop_regex: str | list[str] | None = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    json_schema: str | None = None
    dtype: str | None = None
    regex: str | None = None

    def clone(self) -> "SglSamplingParams":
        return dataclasses.replace(self)

    def to_srt_kwargs(self) -> dict:
        """The sampling_params of a /generate request (SGLang's server names)."""
        names = ("max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
                 "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex",
                 "json_schema")
        return {k: getattr(self, k) for k in names}


class _Unsupported(Expr):
    def __init__(self, *args, **kwargs):
        from deepinfer_lang.unsupported import UnsupportedFeatureError

        raise UnsupportedFeatureError(f"sglang.lang.ir.{type(self).__name__}: SGLang's tracer nodes are not "
                                      f"provided (programs run eagerly here)")


class SglArgument(_Unsupported):
    pass


class SglFork(_Unsupported):
    pass


class SglGetForkItem(_Unsupported):
    pass


class SglVariable(_Unsupported):
    pass


class SglCommitLazy(_Unsupported):
    pass


class SglConcateAndAppend(_Unsupported):
    pass
