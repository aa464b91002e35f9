"""python -m benchmark.sglang_programs [--num-items N] [--model ...]: every ported program, one report line each."""
import importlib

from benchmark.sglang_programs import PROGRAMS
from benchmark.sglang_programs.harness import main

if __name__ == "__main__":
    main([importlib.import_module(f"benchmark.sglang_programs.{name}") for name in PROGRAMS])
