"""sglang.lang.interpreter: program states and running programs."""
from deepinfer_lang.interpreter import ProgramState, ProgramStateGroup  # noqa: F401
from deepinfer_lang.runner import run_program, run_program_batch  # noqa: F401

StreamExecutor = ProgramState  # SGLang's per-state executor: our ProgramState executes its own expressions
