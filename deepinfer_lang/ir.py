"""Expression nodes: what `s += ...` appends to a program state.

Nodes only describe; the interpreter gives them meaning against a ProgramState. `+` between nodes and strings
builds an ExprList, so `s += "Q: " + question + "\nA:" + gen("answer")` is a single append.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deepinfer_lang.choices import ChoicesSamplingMethod
from deepinfer_rt import SamplingParams


class Expr:
    def __add__(self, other) -> "ExprList":
        return ExprList((*_items(self), *_items(as_expr(other))))

    def __radd__(self, other) -> "ExprList":
        return ExprList((*_items(as_expr(other)), *_items(self)))


def as_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if value is None:
        raise ValueError("cannot append None to a program")
    raise TypeError(f"cannot append a {type(value).__name__} to a program: append a str or gen/select/role "
                    f"expressions (format values into strings first)")


def _items(expr: Expr) -> tuple[Expr, ...]:
    return expr.items if isinstance(expr, ExprList) else (expr,)


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.items, tuple):  # SGLang builds SglExprList([...]) from a list
            object.__setattr__(self, "items", tuple(self.items))

    @property
    def expr_list(self) -> list[Expr]:
        """SGLang's name of the items."""
        return list(self.items)


@dataclass(frozen=True)
class GenArgs:
    """Sampling arguments of one gen, named as SamplingParams fields. None means not given: the program's
    run() default applies, then SamplingParams' own default."""
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    # SGLang's logprob options that are not SamplingParams fields (see to_sampling_params)
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool | None = None

    def over(self, defaults: "GenArgs") -> "GenArgs":
        """These arguments where given, `defaults` elsewhere."""
        return GenArgs(**{f.name: getattr(defaults, f.name) if getattr(self, f.name) is None
                          else getattr(self, f.name) for f in dataclasses.fields(self)})

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of the given fields. logprob_start_len >= 0 (with logprobs) also asks for the prompt's
        logprobs from that position (SGLang's input_token_logprobs); -1 or None: output logprobs only."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if getattr(self, f.name) is not None and f.name not in _NOT_SAMPLING_FIELDS}
        if self.logprobs and self.logprob_start_len is not None and self.logprob_start_len >= 0:
            given.update(prompt_logprobs=True, logprob_start_len=self.logprob_start_len)
        return SamplingParams(**given)


_NOT_SAMPLING_FIELDS = ("logprob_start_len", "return_text_in_logprobs")


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    args: GenArgs


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: ChoicesSamplingMethod


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """After `expr` ran: split each of its gens'/selects' text into reasoning and answer (api.separate_reasoning)."""
    model_type: str | None
    expr: Expr | None

    @property
    def name(self) -> str | None:
        names = [n for n in _gen_names(self.expr)]
        return reasoning_name(names[0]) if names else None


def reasoning_name(name: str | None) -> str:
    if not name:
        raise ValueError("separate_reasoning: the gen or select must have a name")
    return f"{name}_reasoning_content"


def _gen_names(expr):
    if isinstance(expr, (Gen, Select)):
        yield expr.name
    elif isinstance(expr, ExprList):
        for item in expr.items:
            yield from _gen_names(item)


@dataclass(frozen=True)
class Image(Expr):
    """An image input (sgl.image): executing it raises UnsupportedFeatureError on our text-only models."""
    path: object


@dataclass(frozen=True)
class Video(Expr):
    path: object
    num_frames: int
