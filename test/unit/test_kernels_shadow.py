"""The checkout's kernels/ folder (deepinfer_kernels) must not shadow PyPI's `kernels`, which transformers >= 5.25
imports, when the repository root is on sys.path (`python -m pytest` or `python -m deepinfer_rt` run from it)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib.util, sys
import deepinfer_rt, deepinfer_kernels
spec = importlib.util.find_spec("kernels")
print(spec.origin if spec else None)
print(deepinfer_kernels.__file__)
"""


def test_root_on_sys_path_resolves_the_installed_kernels_package():
    other = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    installed = importlib.machinery.PathFinder.find_spec("kernels", other)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True)
    origin, ours = out.stdout.split()
    assert Path(ours).resolve() == ROOT / "kernels" / "__init__.py"
    # With none installed the finder steps aside and the name resolves as Python would resolve it anyway.
    expected = Path(installed.origin) if installed is not None else ROOT / "kernels" / "__init__.py"
    assert Path(origin).resolve() == expected.resolve()
