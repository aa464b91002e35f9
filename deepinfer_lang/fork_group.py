"""ProgramStateGroup: the branches of s.fork(n), appended to together and joined back into their parent."""
from __future__ import annotations

from typing import Iterator

from deepinfer_lang.ir import Expr

# Branches are interpreter.ProgramState objects (not imported: the interpreter imports this module).


class ProgramStateGroup:
    """The branches of s.fork(n). `forks += x` appends x to every branch (a list: x[i] to branch i; a callable:
    x(i) to branch i); forks[i] is branch i. join() waits for the branches and brings their results back."""

    def __init__(self, branches: list[ProgramState], parent: ProgramState):
        self._branches = branches
        self._parent = parent

    @property
    def states(self) -> list[ProgramState]:
        return self._branches

    @property
    def src_state(self) -> ProgramState:
        return self._parent

    def __setitem__(self, i: int, value) -> None:
        """`forks[i] += x` appends to branch i, then stores the branch back: only that same branch may be stored."""
        if value is not self._branches[i]:
            raise TypeError(f"fork branches cannot be replaced: forks[{i}] can only be assigned its own branch "
                            f"(as `forks[{i}] += ...` does)")

    def __len__(self) -> int:
        return len(self._branches)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self._branches)

    def __getitem__(self, i: int) -> ProgramState:
        return self._branches[i]

    def __iadd__(self, other) -> "ProgramStateGroup":
        if isinstance(other, (list, tuple)) and len(other) != len(self._branches):
            raise ValueError(f"forks += list: {len(other)} items for {len(self._branches)} branches")
        if not (callable(other) or isinstance(other, (list, tuple, str, Expr))):
            raise ValueError(f"forks += {type(other).__name__}: append a str, an expression, a list of them (one "
                             f"per branch) or a function of the branch index")
        for i, branch in enumerate(self._branches):
            if callable(other) and not isinstance(other, Expr):
                branch += other(i)
            elif isinstance(other, (list, tuple)):
                branch += other[i]
            else:
                branch += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable a branch set becomes, in the parent, the list of the branches' values
        (meta info likewise). concate_and_append: the parent appends each branch's new text, in branch order
        (its ids as the branch computed them)."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for i, branch in enumerate(self._branches):
            branch._wait()
            if branch._error is not None:
                raise RuntimeError(f"fork branch {i} of program {branch.program_name!r} failed: "
                                   f"{branch._error}") from branch._error
        parent = self._parent
        parent._wait()
        if mode == "gather_variable":
            names = dict.fromkeys(name for branch in self._branches for name in branch._assigned)
            for name in names:
                setters = [branch for branch in self._branches if name in branch._assigned]
                parent._set_var(name, [b._variables[name] for b in setters], [b._meta_info[name] for b in setters])
        else:
            for branch in self._branches:
                parent._append(branch._text[branch._fork_text_start:], branch.ids[branch._fork_ids_start:])
        for branch in self._branches:
            branch._close()
