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

    def over(self, defaults: "GenArgs") -> "GenArgs":
        """These arguments where given, `defaults` elsewhere."""
        return GenArgs(**{f.name: getattr(defaults, f.name) if getattr(self, f.name) is None
                          else getattr(self, f.name) for f in dataclasses.fields(self)})

    def to_sampling_params(self) -> SamplingParams:
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        return SamplingParams(**given)


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
