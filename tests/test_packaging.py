"""Every package in the tree is one a wheel installs.

Why: pyproject.toml lists kvroute's packages by name (the top-level folders install as the
``kvroute.*`` namespace through ``package-dir``). An editable install finds a sub-package
missing from that list anyway, by path, so the suite and ``pip install -e`` never notice;
a wheel (``pip install .``, a cluster image) leaves it out and fails at its first import.
That happened to ``replica/kv_transfer/`` and ``router/api/agents/tool_parsers/``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_an_init_is_a_listed_package():
    conf = _setuptools()
    listed = set(conf["packages"])
    found = set()
    for name, folder in conf["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join((name, *rel.parts)))
    assert found, "no package found under package-dir"
    assert sorted(found - listed) == [], "pyproject.toml's packages misses these"
    assert sorted(listed - found) == [], "pyproject.toml lists packages that do not exist"
