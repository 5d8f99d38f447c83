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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [requirement_name(r) for r in project["dependencies"]]
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


def test_an_editable_install_is_a_path_entry_so_a_folder_named_dprun_cannot_shadow_the_package(tmp_path, monkeypatch):
    """A script beside the clone (a folder named dprun, the real package one level down) must import the package.
    setuptools' editable import hook runs after Python's path search, which takes that folder for an empty namespace
    package; a plain .pth entry (the checkout root) is searched by the path search itself, and a regular package
    beats a namespace portion. setup.py's layout must therefore select setuptools' static-.pth strategy."""
    import os
    import subprocess
    from pathlib import Path

    import runpy

    editable = pytest.importorskip("setuptools.command.editable_wheel")
    import setuptools
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    attrs: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: attrs.update(kw))  # setup.py's arguments, not a build
    runpy.run_path(str(ROOT / "setup.py"))
    dist = Distribution({"name": "dprun", **attrs})
    cmd = editable.editable_wheel(dist)
    cmd.ensure_finalized()
    strategy = cmd._select_strategy("dprun", "0.1.0", str(tmp_path / "build"))
    entries = [Path(p).resolve() for p in getattr(strategy, "path_entries", [])]
    assert isinstance(strategy, editable._StaticPth) and entries == [ROOT.resolve()], type(strategy).__name__

    # the install's .pth, a clone folder named dprun (no __init__.py at its top) and a script beside it
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "__editable__.dprun-0.1.0.pth").write_text("\n".join(map(str, entries)) + "\n")
    (tmp_path / "work" / "dprun" / "docs").mkdir(parents=True)
    script = tmp_path / "work" / "script.py"
    script.write_text("import importlib.util, site, sys\n"
                      "if sys.argv[1:]: site.addsitedir(sys.argv[1])  # what the installed .pth does\n"
                      "print(importlib.util.find_spec('dprun').origin)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def origin(*args):  # -S: no site-packages, so whatever this venv has installed is not seen
        out = subprocess.run([sys.executable, "-S", str(script), *args], env=env, capture_output=True, text=True,
                             timeout=60, cwd=tmp_path / "work")
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert origin() == "None"  # the hazard: without the path entry the folder is a namespace package
    assert Path(origin(str(tmp_path / "site"))) == ROOT.resolve() / "dprun" / "__init__.py"
