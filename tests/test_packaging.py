"""A wheel (`pip install .`, not the editable install the tests run from) carries every package of the source tree:
setuptools installs only the packages pyproject.toml lists, so a new subpackage left off the list works here and
is missing from a user's install."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_with_an_init_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "build" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), "subpackages missing from pyproject.toml's packages"
