"""Public functions of the language, named and shaped like SGLang's frontend (`import deepinfer_lang as sgl`)."""
from __future__ import annotations

import functools
import inspect
import re
from typing import Callable

from deepinfer_lang.backend import RuntimeBackend, get_default_backend
from deepinfer_lang.choices import ChoicesSamplingMethod, token_length_normalized
from deepinfer_lang.config import global_config
from deepinfer_lang.interpreter import ProgramState
from deepinfer_lang.runner import prefill_program_prefix, run_program, run_program_batch, run_program_batch_iter
from deepinfer_lang.ir import (Expr, ExprList, Gen, GenArgs, Image, RoleBegin, RoleEnd, Select, SeparateReasoning,
                               Video, as_expr)
from deepinfer_lang.unsupported import UnsupportedFeatureError

# gen(dtype=...) constrains the text with these (SGLang's regexes, sglang.lang.ir's names). Numbers may end with
# spaces or a newline, which the added stop strings then cut, so the model has a way to end the number before
# max_tokens.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
_DTYPE_REGEX = {
    "int": (REGEX_INT, [" ", "\n"]),
    "float": (REGEX_FLOAT, [" ", "\n"]),
    "str": (REGEX_STR, []),
    "bool": (REGEX_BOOL, []),
}


# run()'s program-wide sampling defaults (SGLang's names) and the GenArgs field each sets.
_RUN_SAMPLING_ARGS = {
    "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos", "return_logprob": "logprobs", "top_logprobs_num": "top_logprobs",
    "n": "n", "logprob_start_len": "logprob_start_len", "return_text_in_logprobs": "return_text_in_logprobs",
    "stop_regex": "stop_regex",
}


def _check_stop_regex(stop_regex, where: str) -> None:
    if stop_regex:
        raise UnsupportedFeatureError(f"{where}: stop_regex is not supported by deepinfer_rt's sampler; use stop "
                                      f"strings, or regex= to constrain the whole output")


def _run_defaults(sampling: dict) -> GenArgs:
    unknown = set(sampling) - set(_RUN_SAMPLING_ARGS)
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; known: {list(_RUN_SAMPLING_ARGS)}")
    _check_stop_regex(sampling.pop("stop_regex", None), "run")
    if sampling.get("n") == 1:
        sampling.pop("n")  # SGLang's run() default; keeps a gen's own n effective
    return GenArgs(**{_RUN_SAMPLING_ARGS[k]: v for k, v in sampling.items()})


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """Decorator: a generation program. The function's first parameter is the state (`s`); `s += ...` appends
    text, gen, select and roles. `@function` and `@function()` both work. num_api_spec_tokens (SGLang's
    speculative execution for chat-only APIs) has no effect here: every gen runs on the engine."""
    if func is None:
        return Program
    return Program(func)


class Program:
    def __init__(self, func: Callable, bind_arguments: dict | None = None):
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"@function {func.__name__}: the first parameter must receive the program state (s)")
        self.func = func
        self.name = func.__name__
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not inspect.Parameter.empty]
        self.bind_arguments = dict(bind_arguments or {})
        self.num_api_spec_tokens = None
        functools.update_wrapper(self, func)

    def bind(self, **kwargs) -> "Program":
        """A copy of the program with these arguments fixed (they override what a run passes for them)."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"bind of {self.name}: {unknown} are not arguments of the program {self.arg_names}")
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def _bound(self, kwargs: dict) -> dict:
        return {**kwargs, **self.bind_arguments}

    def cache(self, backend: RuntimeBackend | None = None) -> None:
        """Compute the program's prompt up to its first model call (the part every run shares when it does not
        depend on the arguments) into the prefix cache."""
        prefill_program_prefix(self.func, self.name, backend or get_default_backend(), GenArgs(),
                               self._bound({}))

    def trace(self, *, backend=None, **kwargs):
        raise UnsupportedFeatureError(f"{self.name}.trace: SGLang's tracer is not provided; run_batch computes the "
                                      f"shared prefix by running the program up to its first model call instead")

    def run(self, *args, stream: bool = False, backend: RuntimeBackend | None = None, use_thread: bool = True,
            **kwargs) -> ProgramState:
        """Run once. Program arguments go by position or name, except SGLang's sampling names (max_new_tokens,
        min_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p, frequency_penalty,
        presence_penalty, ignore_eos, return_logprob, top_logprobs_num): those are defaults for every gen of the
        program (a gen's own arguments win; unset ones fall back to SamplingParams' defaults, e.g.
        max_new_tokens=128, temperature=1.0). With stream=True the program runs in the background: read
        state.text_iter(); reading a variable from another thread waits for the program to finish."""
        defaults = _run_defaults({k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_SAMPLING_ARGS})
        return run_program(self.func, self.name, backend or get_default_backend(), args, self._bound(kwargs),
                           defaults, stream)

    def run_batch(self, batch_kwargs: list[dict] | list[tuple], *, backend: RuntimeBackend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  **sampling) -> list[ProgramState]:
        """Run the program once per item (a dict of arguments, or a tuple of them in order) concurrently, so the
        engine batches them; `sampling` as in run(). Returns the states in input order (generator_style: yields
        them in input order as they finish); a program that raised keeps its exception in state.error() and
        the others finish. progress_bar shows a tqdm bar; num_threads="auto" runs as many programs at once as
        the engine runs requests."""
        defaults = _run_defaults(sampling)
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"run_batch of {self.name}: give a list of argument dicts or tuples")
        batch = [self._bound(item if isinstance(item, dict) else self._kwargs_of(item)) for item in batch_kwargs]
        run = run_program_batch_iter if generator_style else run_program_batch
        return run(self.func, self.name, backend or get_default_backend(), batch, defaults, num_threads,
                   progress_bar)

    def _kwargs_of(self, values) -> dict:
        num_required = len(self.arg_names) - len(self.arg_defaults)
        if not isinstance(values, (list, tuple)) or not num_required <= len(values) <= len(self.arg_names):
            raise ValueError(f"run_batch of {self.name}: each item must be a dict of arguments or a tuple of at "
                             f"most {len(self.arg_names)} values {self.arg_names}, got {values!r}")
        return dict(zip(self.arg_names, values))

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: type | str | None = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: str | dict | None = None) -> Expr:
    """Generate into variable `name`. Unset arguments take the program's run() defaults. With `choices` this is
    select(name, choices, ...); `dtype` (int, float, str, bool or their names) constrains the text to a literal
    of that type (the variable still holds the text). return_logprob adds output_token_logprobs (and with
    logprob_start_len >= 0, input_token_logprobs from that prompt position) to the meta info, as (logprob,
    token_id, text) entries whose text is set with return_text_in_logprobs. stop_regex is not supported."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    _check_stop_regex(stop_regex, f"gen {name!r}")
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
                             regex=regex, json_schema=json_schema, logprob_start_len=logprob_start_len,
                             return_text_in_logprobs=return_text_in_logprobs))


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


def flush_cache(backend: RuntimeBackend | None = None) -> bool:
    """Empty the engine's prefix cache (of `backend`, or the default backend); False when there is no backend."""
    backend = backend or global_config.default_backend
    if backend is None:
        return False
    return backend.flush_cache()


def get_server_info(backend: RuntimeBackend | None = None) -> dict | None:
    """The backend's model and engine figures (a server's /get_server_info); None when there is no backend."""
    backend = backend or global_config.default_backend
    if backend is None:
        return None
    return backend.get_server_info()


def separate_reasoning(expr: Expr | None = None, model_type: str | None = None) -> Expr:
    """Run `expr` (typically a gen), then split its text: the variable keeps the answer and
    `<name>_reasoning_content` the reasoning inside the model family's think markers (model_type as SGLang's
    reasoning parsers name them: deepseek-r1, qwen3, qwen3-thinking, kimi, ...); the role's text keeps only the
    answer."""
    node = SeparateReasoning(model_type, expr)
    if expr is None:
        return node
    return ExprList((as_expr(expr), node))


def image(expr) -> Expr:
    """An image input; programs with one fail when they run (text-only models: UnsupportedFeatureError)."""
    return Image(expr)


def video(path: str, num_frames: int) -> Expr:
    """A video input; programs with one fail when they run (text-only models: UnsupportedFeatureError)."""
    return Video(path, num_frames)
