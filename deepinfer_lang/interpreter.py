"""ProgramState: runs a program's expressions against a backend, keeping the prompt as token ids.

The prompt is a list of token ids that only grows: each appended text segment is tokenized on its own, and a
gen appends the ids the model produced. Every model call therefore sends an extension of the ids sent before,
which the engine's prefix cache matches exactly; tokenizing the whole text again could merge tokens across a
segment boundary (say "\\n" + "\\n") and miss the cache from there on.

Where expressions execute:
  run()                      each `s += ...` executes at once, in the thread running the program function;
  run(stream=True)           the same, on a background thread, while the caller reads text_iter();
  fork branches (s.fork(n))  each branch has its own worker thread: `+=` on a branch queues the expression and
                             returns, so the branches' gens reach the engine together and share its steps.
                             Reading a branch (a variable, its text, join) waits for its queue.
run_batch (runner.py) runs programs on a thread pool, and the engine batches the concurrent calls of all of them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from deepinfer_lang.backend import RuntimeBackend
from deepinfer_lang.fork_group import ProgramStateGroup
from deepinfer_lang.gen_meta import UnknownVariableError, gen_meta
from deepinfer_lang.ir import (Expr, ExprList, Gen, GenArgs, Image, RoleBegin, RoleEnd, Select, SeparateReasoning,
                               Text, VarScopeBegin, VarScopeEnd, Video, as_expr, reasoning_name)
from deepinfer_lang.reasoning import split_reasoning
from deepinfer_lang.unsupported import multimodal_error
from deepinfer_rt import GenerateOutput

logger = logging.getLogger("deepinfer_lang")

# When k > 1 requests are about to extend the same prompt (a select's choices, fork branches), the part of the
# prompt not computed by an earlier call is prefilled once into the prefix cache if it is at least this long;
# a shorter part costs less to recompute in each request than an extra engine round trip.
_MIN_TOKENS_TO_PREFILL_ONCE = 16


_current = threading.local()


def current_program_id() -> str | None:
    """The id of the program run whose expressions execute on this thread (fork branches share their root's),
    for instrumentation: e.g. a backend wrapper grouping its calls by program."""
    return getattr(_current, "program_id", None)


class _PrefixEnd(Exception):
    """Ends a prefix probe at its first model call (see runner.prefill_program_prefix)."""


@contextmanager
def _named(what: str, program_name: str):
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{what} in program {program_name!r}: {e}") from e


class ProgramState:
    def __init__(self, backend: RuntimeBackend, program_name: str, defaults: GenArgs, *, is_streaming: bool = False,
                 is_prefix_probe: bool = False):
        self.backend = backend
        self.program_name = program_name
        self.defaults = defaults
        self.ids: list[int] = []
        self.ret_value: Any = None
        self.program_id = uuid.uuid4().hex  # a fork branch: its root's
        self._text = ""
        self._variables: dict[str, Any] = {}
        self._meta_info: dict[str, Any] = {}
        self._messages: list[dict] = []
        self._open_role: str | None = None  # the open role, where its content starts in _text, its closing text
        self._role_start = 0
        self._role_start_ids = 0  # where the open role's content starts in ids
        self._var_scopes: dict[str, int] = {}  # open var_scope name -> where its text starts
        self._role_end_text = ""
        self._num_known_cached = 0  # leading ids an earlier model call of this state computed
        self._assigned: dict[str, None] = {}  # variables set by this state (a branch: since its fork), in order
        self._fork_text_start = 0
        self._fork_ids_start = 0
        self._branches: list[ProgramState] = []
        self._executor: ThreadPoolExecutor | None = None  # a fork branch's worker
        self._last_queued: Future | None = None
        self._is_closed = False
        self._owner = threading.current_thread()  # where this state's expressions execute (streaming root)
        self._finished: threading.Event | None = None  # streaming root: set when the program function returned
        self._error: Exception | None = None
        self._is_streaming = is_streaming
        self._is_prefix_probe = is_prefix_probe
        self._changed = threading.Condition()  # notified when text or a variable grows (text_iter)

    # ---- building the program ----
    def __iadd__(self, other) -> "ProgramState":
        self._submit(as_expr(other))
        return self

    def system(self, content=None):
        return self._role("system", content)

    def user(self, content=None):
        return self._role("user", content)

    def assistant(self, content=None):
        return self._role("assistant", content)

    def _role(self, role: str, content):
        """With content: append the whole message. Without: a context manager (`with s.user(): ...`)."""
        if content is None:
            return self._role_scope(role)
        self._submit(ExprList((RoleBegin(role), as_expr(content), RoleEnd(role))))

    @contextmanager
    def _role_scope(self, role: str):
        self._submit(RoleBegin(role))
        yield
        self._submit(RoleEnd(role))

    @contextmanager
    def var_scope(self, name: str):
        """`with s.var_scope("name"): ...`: variable `name` becomes the text appended inside the block (scopes
        nest; each holds all the text of its own block)."""
        self._submit(VarScopeBegin(name))
        yield
        self._submit(VarScopeEnd(name))

    @contextmanager
    def copy(self, position_ids_offset=None):
        """`with s.copy() as c: ...`: a one-branch fork, joined (gather_variable) when the block ends."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        """`size` copies of this state, each executing on its own worker thread (see the module docstring)."""
        self._wait()  # a branch forking: what it has queued must be in its ids before they are copied
        self._prefill_shared_prefix(size)
        branches = [self._branch() for _ in range(size)]
        self._branches += branches
        return ProgramStateGroup(branches, self)

    # ---- reading results ----
    def __getitem__(self, name: str):
        return self.get_var(name)

    def __setitem__(self, name: str, value) -> None:
        self._set_var(name, value, None)

    def __contains__(self, name: str) -> bool:
        self._wait()
        return name in self._variables

    def __bool__(self) -> bool:
        return True

    def get_var(self, name: str):
        self._wait()
        if name not in self._variables:
            raise self._unknown(name) from self._error
        return self._variables[name]

    def set_var(self, name: str, value) -> None:
        self._set_var(name, value, None)

    def get_meta_info(self, name: str) -> dict | list[dict] | None:
        """Of a gen: prompt_tokens, completion_tokens, cached_tokens, finish_reason (+ output_token_logprobs /
        output_top_logprobs as (logprob, token_id) when asked); a list of those when n > 1 or after join.
        Of a select: scores (the method's score per choice), normalized_prompt_logprobs, input_token_logprobs,
        prompt_tokens and cached_tokens summed over the select's engine requests."""
        self._wait()
        if name not in self._variables:
            raise self._unknown(name) from self._error
        return self._meta_info.get(name)

    def text(self) -> str:
        self._wait()
        return self._text

    def messages(self) -> list[dict]:
        """The finished role messages, as {"role", "content"} dicts."""
        self._wait()
        return [dict(m) for m in self._messages]

    def error(self) -> Exception | None:
        """Why the program failed (run_batch, run(stream=True) and fork branches keep it here), or None."""
        self._wait()
        return self._error

    def sync(self) -> None:
        self._wait()

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False):
        """text_iter for asyncio code: the same pieces, each awaited without blocking the event loop. With
        return_meta_data (a variable's stream), items are (piece, the variable's meta info so far or None)."""
        loop = asyncio.get_running_loop()
        pieces = self.text_iter(var_name)
        done = object()
        while True:
            piece = await loop.run_in_executor(None, next, pieces, done)
            if piece is done:
                return
            if return_meta_data:
                yield piece, self._meta_info.get(var_name)
            else:
                yield piece

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Pieces of the text (or of one variable) as a run(stream=True) program produces them; they join to
        the final text. Without streaming, the whole text (or variable) once."""
        if not self._is_streaming:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        num_seen = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self._current(var_name)) > num_seen or self._finished.is_set())
                piece = self._current(var_name)[num_seen:]
                is_finished = self._finished.is_set()
            num_seen += len(piece)
            if piece:
                yield piece
            if is_finished:
                if var_name is not None and var_name not in self._variables:
                    raise self._unknown(var_name) from self._error
                return

    def _current(self, var_name: str | None) -> str:
        return self._text if var_name is None else self._variables.get(var_name, "")

    def _unknown(self, name: str) -> UnknownVariableError:
        why = ""
        if self._error is not None:
            why = f"; the program failed first: {type(self._error).__name__}: {self._error}"
        return UnknownVariableError(f"variable {name!r} is not set in program {self.program_name!r} "
                                    f"(set: {sorted(self._variables)}){why}")

    def __repr__(self) -> str:
        return f"ProgramState({self.program_name}, {self._text!r})"

    # ---- execution ----
    def _submit(self, expr: Expr) -> None:
        if self._executor is None:
            self._execute(expr)
            return
        if self._is_closed:
            raise RuntimeError(f"a fork branch of program {self.program_name!r} was already joined; append to the "
                               f"parent state instead")
        self._last_queued = self._executor.submit(self._execute_queued, expr)

    def _execute_queued(self, expr: Expr) -> None:
        # A branch stops at its first error; join() and reads of the branch report it.
        if self._error is None:
            _current.program_id = self.program_id
            try:
                self._execute(expr)
            except Exception as e:
                self._error = e

    def _wait(self) -> None:
        """Block until the expressions queued on this state have executed (at once on its own thread)."""
        if self._finished is not None and threading.current_thread() is not self._owner:
            self._finished.wait()
        if self._last_queued is not None:
            self._last_queued.result()  # one worker runs the queue in order: the last done means all done

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append_text(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._begin_role(expr.role)
        elif isinstance(expr, RoleEnd):
            self._end_role(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._var_scopes[expr.name] = len(self._text)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self._var_scopes:
                raise ValueError(f"program {self.program_name!r}: var_scope {expr.name!r} ends but never began")
            self._set_var(expr.name, self._text[self._var_scopes.pop(expr.name):], None)
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr.model_type, expr.expr)
        elif isinstance(expr, Image):
            raise multimodal_error("image")
        elif isinstance(expr, Video):
            raise multimodal_error("video")
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _model(self) -> RuntimeBackend:
        """The backend, for a call that runs the model (where a prefix probe stops)."""
        if self._is_prefix_probe:
            raise _PrefixEnd
        return self.backend

    def _append(self, text: str, ids: list[int]) -> None:
        with self._changed:
            self._text += text
            self.ids += ids
            self._changed.notify_all()

    def _append_text(self, text: str) -> None:
        if text:
            self._append(text, self.backend.encode(text, is_first=not self.ids))

    def _set_var(self, name: str | None, value, meta) -> None:
        if name is None:
            return
        with self._changed:
            self._variables[name] = value
            self._meta_info[name] = meta
            self._assigned[name] = None
            self._changed.notify_all()

    def _prompt_ids(self, what: str) -> list[int]:
        if not self.ids:
            self.ids = list(self.backend.bos_ids)
        if not self.ids:
            raise ValueError(f"{what} in program {self.program_name!r}: the prompt is empty; append text first")
        return list(self.ids)

    def _prefill_shared_prefix(self, num_sharers: int) -> GenerateOutput | None:
        backend = self._model()
        num_uncached = len(self.ids) - self._num_known_cached
        if num_sharers < 2 or not backend.is_prefix_cache_enabled or num_uncached < _MIN_TOKENS_TO_PREFILL_ONCE:
            return None
        out = backend.cache_prefix(list(self.ids))
        self._num_known_cached = len(self.ids)
        return out

    def _gen(self, gen: Gen) -> None:
        what = f"gen {gen.name!r}"
        backend = self._model()
        params = gen.args.over(self.defaults).to_sampling_params()
        prompt = self._prompt_ids(what)
        if self._is_streaming and params.n == 1:
            with _named(what, self.program_name):
                self._stream_gen(gen.name, prompt, params)
            return
        start = time.perf_counter()
        with _named(what, self.program_name):
            outs = backend.generate(prompt, params)
        latency = time.perf_counter() - start
        for out in outs:
            if out.finish_reason in ("error", "abort"):
                raise RuntimeError(f"{what} in program {self.program_name!r} failed: {out.error or out.finish_reason}")
        self._append(outs[0].text, backend.output_ids(prompt, outs[0], params))
        self._num_known_cached = len(prompt)
        metas = [gen_meta(o, prompt, params, gen.args.over(self.defaults), self.backend, latency) for o in outs]
        if params.n == 1:
            self._set_var(gen.name, outs[0].text, metas[0])
        else:
            self._set_var(gen.name, [o.text for o in outs], metas)

    def _stream_gen(self, name: str | None, prompt: list[int], params) -> None:
        text = ""
        for delta in self.backend.stream(prompt, params):
            text += delta
            with self._changed:
                self._text += delta
                if name is not None:
                    self._variables[name] = text
                self._changed.notify_all()
        # engine.stream yields text only: the ids are that text tokenized afresh, and there are no cache or
        # finish figures to report.
        ids = self.backend.encode(text, is_first=False)
        self.ids += ids
        self._set_var(name, text, {"prompt_tokens": len(prompt), "completion_tokens": len(ids)})

    def _select(self, sel: Select) -> None:
        what = f"select {sel.name!r}"
        backend = self._model()
        choice_ids = [backend.encode(choice, is_first=False) for choice in sel.choices]
        for choice, ids in zip(sel.choices, choice_ids):
            if not ids:
                raise ValueError(f"{what} in program {self.program_name!r}: choice {choice!r} has no tokens")
        prefix = self._prompt_ids(what)
        prefill = self._prefill_shared_prefix(len(choice_ids))
        with _named(what, self.program_name):
            decision = backend.select(prefix, choice_ids, sel.temperature, sel.choices_method, list(sel.choices))
        meta = decision.meta_info
        if prefill is not None:
            meta["prompt_tokens"] += prefill.prompt_tokens
            meta["cached_tokens"] += prefill.cached_tokens
        choice = sel.choices[decision.index]
        self._append(choice, choice_ids[decision.index])
        self._num_known_cached = len(prefix) + len(choice_ids[decision.index])
        self._set_var(sel.name, choice, meta)

    def _begin_role(self, role: str) -> None:
        if self._open_role is not None:
            raise ValueError(f"program {self.program_name!r}: the {role} role begins inside the {self._open_role} "
                             f"role (roles do not nest)")
        begin, end = self.backend.chat_template.role_segments(self._messages, role)
        self._append_text(begin)
        self._open_role, self._role_start, self._role_end_text = role, len(self._text), end
        self._role_start_ids = len(self.ids)

    def _separate_reasoning(self, model_type: str | None, expr: Expr | None) -> None:
        """Each named gen/select of `expr`: its variable keeps the answer, `<name>_reasoning_content` gets the
        reasoning, and (as in SGLang) the open role's text becomes the answer (the reasoning leaves the prompt).
        Streaming programs are left as they are (SGLang does not split streams either)."""
        if expr is None or self._is_streaming:
            return
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._separate_reasoning(model_type, item)
            return
        if not isinstance(expr, (Gen, Select)):
            return
        name = reasoning_name(expr.name)
        text = self._variables[expr.name]
        reasoning, answer = split_reasoning(model_type, text)
        self._set_var(expr.name, answer, self._meta_info.get(expr.name))
        self._set_var(name, reasoning, None)
        if self._open_role is not None and self._text[self._role_start:].endswith(text):
            with self._changed:
                self._text = self._text[: self._role_start] + answer
                self.ids = self.ids[: self._role_start_ids] + self.backend.encode(answer, is_first=not
                                                                                   self._role_start_ids)
                self._num_known_cached = min(self._num_known_cached, self._role_start_ids)

    def _end_role(self, role: str) -> None:
        if self._open_role != role:
            raise ValueError(f"program {self.program_name!r}: the {role} role ends but the open role is "
                             f"{self._open_role}")
        content = self._text[self._role_start:]
        self._append_text(self._role_end_text)
        self._messages.append({"role": role, "content": content})
        self._open_role = None

    # ---- fork / lifetime ----
    def _branch(self) -> "ProgramState":
        branch = ProgramState(self.backend, self.program_name, self.defaults)
        branch.program_id = self.program_id
        branch.ids, branch._text = list(self.ids), self._text
        branch._variables, branch._meta_info = dict(self._variables), dict(self._meta_info)
        branch._messages = list(self._messages)
        branch._open_role, branch._role_start = self._open_role, self._role_start
        branch._role_start_ids, branch._var_scopes = self._role_start_ids, dict(self._var_scopes)
        branch._role_end_text = self._role_end_text
        branch._num_known_cached = self._num_known_cached
        branch._fork_text_start, branch._fork_ids_start = len(self._text), len(self.ids)
        branch._executor = ThreadPoolExecutor(1, thread_name_prefix=f"deepinfer-lang-{self.program_name}")
        return branch

    def _close(self) -> None:
        """Let every branch finish its queue and stop its worker (at join, and when the program returns)."""
        for branch in self._branches:
            branch._wait()
            branch._close()
        if self._executor is not None and not self._is_closed:
            self._executor.shutdown()
            self._is_closed = True
