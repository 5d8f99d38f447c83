"""Packaging: the core install (`pip install dprun`, no extras) runs the default command."""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys

import pytest

from conftest import ROOT, compose_config


def requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ (]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def core_closure() -> set[str]:
    """The distributions `pip install dprun` brings: pyproject's dependencies and theirs (no extras)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    todo = [requirement_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [requirement_name(r) for r in md.requires(name) or [] if "extra ==" not in r]
        except md.PackageNotFoundError:
            pass
    return seen


def test_the_default_dataset_needs_no_extra():
    """`pip install dprun` then `dprun` must run: every third-party import of the default dataset's loader comes with
    the core install (scikit-learn for digits was only in the `demo` extra)."""
    dataset = compose_config([]).dataset.name
    tree = ast.parse((ROOT / "runner" / "data" / f"{dataset}.py").read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    third_party = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"runner", "__future__"}
    dists = md.packages_distributions()
    core = core_closure()
    missing = {m: dists.get(m) for m in third_party
               if not any(requirement_name(d) in core for d in dists.get(m, []))}
    assert not missing, f"dataset={dataset} imports packages outside the core install: {missing}"
