"""Public functions of the language, named and shaped like SGLang's frontend (`import deepinfer_lang as sgl`)."""
from __future__ import annotations

import functools
import inspect
import re
from typing import Callable

from deepinfer_lang.backend import RuntimeBackend, get_default_backend
from deepinfer_lang.choices import ChoicesSamplingMethod, token_length_normalized
from deepinfer_lang.interpreter import ProgramState
from deepinfer_lang.runner import run_program, run_program_batch
from deepinfer_lang.ir import Expr, ExprList, Gen, GenArgs, RoleBegin, RoleEnd, Select, as_expr

# gen(dtype=...) constrains the text with these (SGLang's regexes). Numbers may end with spaces or a newline,
# which the added stop strings then cut, so the model has a way to end the number before max_tokens.
_DTYPE_REGEX = {
    "int": (r"[-+]?[0-9]+[ \n]*", [" ", "\n"]),
    "float": (r"[-+]?[0-9]*\.?[0-9]+[ \n]*", [" ", "\n"]),
    "str": (r"\"[\w\d\s]*\"", []),
    "bool": (r"(True|False)", []),
}


# run()'s program-wide sampling defaults (SGLang's names) and the GenArgs field each sets.
_RUN_SAMPLING_ARGS = {
    "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos", "return_logprob": "logprobs", "top_logprobs_num": "top_logprobs",
}


def _run_defaults(sampling: dict) -> GenArgs:
    unknown = set(sampling) - set(_RUN_SAMPLING_ARGS)
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; known: {list(_RUN_SAMPLING_ARGS)}")
    return GenArgs(**{_RUN_SAMPLING_ARGS[k]: v for k, v in sampling.items()})


def function(func: Callable | None = None):
    """Decorator: a generation program. The function's first parameter is the state (`s`); `s += ...` appends
    text, gen, select and roles. `@function` and `@function()` both work."""
    if func is None:
        return Program
    return Program(func)


class Program:
    def __init__(self, func: Callable):
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"@function {func.__name__}: the first parameter must receive the program state (s)")
        self.func = func
        self.name = func.__name__
        self.arg_names = [p.name for p in params[1:]]
        functools.update_wrapper(self, func)

    def run(self, *args, stream: bool = False, backend: RuntimeBackend | None = None, **kwargs) -> ProgramState:
        """Run once. Program arguments go by position or name, except SGLang's sampling names (max_new_tokens,
        min_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p, frequency_penalty,
        presence_penalty, ignore_eos, return_logprob, top_logprobs_num): those are defaults for every gen of the
        program (a gen's own arguments win; unset ones fall back to SamplingParams' defaults, e.g.
        max_new_tokens=128, temperature=1.0). With stream=True the program runs in the background: read
        state.text_iter(); reading a variable from another thread waits for the program to finish."""
        defaults = _run_defaults({k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_SAMPLING_ARGS})
        return run_program(self.func, self.name, backend or get_default_backend(), args, kwargs, defaults, stream)

    def run_batch(self, batch_kwargs: list[dict] | list[tuple], *, backend: RuntimeBackend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, **sampling) -> list[ProgramState]:
        """Run the program once per item (a dict of arguments, or a tuple of them in order) concurrently, so the
        engine batches them; `sampling` as in run(). Returns the states in input order; a program that raised
        keeps its exception in state.error() and the others finish."""
        defaults = _run_defaults(sampling)
        batch = [item if isinstance(item, dict) else self._kwargs_of(item) for item in batch_kwargs]
        return run_program_batch(self.func, self.name, backend or get_default_backend(), batch, defaults,
                                 num_threads, progress_bar)

    def _kwargs_of(self, values) -> dict:
        if not isinstance(values, (list, tuple)) or len(values) > len(self.arg_names):
            raise ValueError(f"run_batch of {self.name}: each item must be a dict of arguments or a tuple of at "
                             f"most {len(self.arg_names)} values {self.arg_names}, got {values!r}")
        return dict(zip(self.arg_names, values))

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, top_logprobs_num: int | None = None,
        dtype: type | str | None = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: str | dict | None = None) -> Expr:
    """Generate into variable `name`. Unset arguments take the program's run() defaults. With `choices` this is
    select(name, choices, ...); `dtype` (int, float, str, bool or their names) constrains the text to a literal
    of that type (the variable still holds the text)."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    if dtype is not None:
        kind = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", dtype)
        if kind not in _DTYPE_REGEX:
            raise ValueError(f"gen {name!r}: dtype must be one of {list(_DTYPE_REGEX)}, got {dtype!r}")
        if regex is not None:
            raise ValueError(f"gen {name!r}: give dtype or regex, not both")
        regex, extra_stop = _DTYPE_REGEX[kind]
        stop = ([stop] if isinstance(stop, str) else list(stop or [])) + extra_stop or None
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen {name!r}: invalid regex {regex!r}: {e}") from e
    return Gen(name, GenArgs(max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
                             stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                             min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                             ignore_eos=ignore_eos, logprobs=return_logprob, top_logprobs=top_logprobs_num,
                             regex=regex, json_schema=json_schema))


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | list[str] | None = None, **kwargs) -> Expr:
    """gen constrained to an integer literal (the variable holds its text)."""
    return gen(name, max_tokens, n=n, stop=stop, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | list[str] | None = None, **kwargs) -> Expr:
    """gen constrained to a double-quoted string of word characters and spaces (quotes included)."""
    return gen(name, max_tokens, n=n, stop=stop, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """Pick one of `choices` by the model's logprobs of each (see choices.py); temperature > 0 samples by the
    method's scores instead of taking the best."""
    if not choices:
        raise ValueError(f"select {name!r}: choices must be a non-empty list of strings, got {choices!r}")
    if not all(isinstance(c, str) for c in choices):
        raise ValueError(f"select {name!r}: choices must be strings, got {choices!r}")
    if temperature < 0:
        raise ValueError(f"select {name!r}: temperature must be >= 0, got {temperature}")
    return Select(name, tuple(choices), temperature, choices_method)


def _role(role: str, content) -> Expr:
    if content is None:
        return ExprList((RoleBegin(role), RoleEnd(role)))
    return ExprList((RoleBegin(role), as_expr(content), RoleEnd(role)))


def system(content: str | Expr | None = None) -> Expr:
    return _role("system", content)


def user(content: str | Expr | None = None) -> Expr:
    return _role("user", content)


def assistant(content: str | Expr | None = None) -> Expr:
    return _role("assistant", content)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def flush_cache(backend: RuntimeBackend | None = None) -> None:
    """Empty the engine's prefix cache (of `backend`, or the default backend)."""
    (backend or get_default_backend()).flush_cache()
