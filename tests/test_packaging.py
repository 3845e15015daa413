"""Each code folder's third-party imports are declared by the extras its users install.

An image built as the README says (`pip install '.[server]'`) has what those extras list and
what they pull in, no more: a module that only the test extra brought (httpx, once) is
missing there, and the code that imports it fails on the cluster while every test passes.
Every import in the folder counts, also those inside functions.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Folder -> the extras whose requirements it may import: its own, and (server) the optional
# grammar engine, whose absence structured.py reports.
EXTRAS = {
    "kernels": ["kernels"],
    "server": ["server", "kernels", "structured"],
    "operator": ["operator"],
    "node_agent": ["node-agent"],
}
# Modules that a declared distribution provides as its own interface (FastAPI's request and
# exception types are Starlette's, and FastAPI pins the version).
PROVIDED_BY = {"starlette": "fastapi"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared(extras: list[str]) -> set[str]:
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for extra in extras:
        names |= {_name(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]}
    return names - {"loraplex"}


def third_party_imports(folder: str) -> dict[str, str]:
    """Top-level module -> a file of `folder` that imports it."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("loraplex", "__future__"):
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("folder", sorted(EXTRAS))
def test_every_third_party_import_is_declared(folder):
    providers = importlib.metadata.packages_distributions()
    want = declared(EXTRAS[folder])
    missing = []
    for module, where in third_party_imports(folder).items():
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not dists & want and PROVIDED_BY.get(module) not in want:
            missing.append(f"{module} (imported by {where}; distribution {'/'.join(sorted(dists))})")
    assert not missing, f"{folder}/ imports what {EXTRAS[folder]} do not declare: {missing}"


def test_the_check_sees_an_undeclared_import():
    assert "httpx" in third_party_imports("server")
    assert "httpx" not in declared(["kernels"])
