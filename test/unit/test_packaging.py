"""pyproject.toml lists every package folder, so a wheel (not only an editable install) carries all of them."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    folders = {"deepinfer_kernels": "kernels"} | {p: p for p in ("deepinfer_rt", "deepinfer_lang")}
    found = set()
    for pkg, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([pkg, *init.parent.relative_to(ROOT / folder).parts]))
    assert found == listed, (sorted(found - listed), sorted(listed - found))
    assert setup["package-dir"] == {"deepinfer_kernels": "kernels"}
