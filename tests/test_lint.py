"""The code is clean under pyproject.toml's ruff rules (`make lint`, CI after the tests): pyflakes (F) and
pycodestyle's errors (E9, E7), lines 120 wide."""
from __future__ import annotations

import subprocess
import sys

import pytest

try:
    import tomllib  # Python 3.11+
except ImportError:  # 3.10
    tomllib = pytest.importorskip("tomli")

from conftest import ROOT


def test_ruff_is_configured_with_pyflakes_and_pycodestyle_errors():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ruff = config["tool"]["ruff"]
    assert ruff["line-length"] == 120 and {"F", "E9", "E7"} <= set(ruff["lint"]["select"])
    assert any(dep.startswith("ruff") for dep in config["project"]["optional-dependencies"]["test"])
    assert "make lint" in (ROOT / ".ci" / "run").read_text()


def test_the_code_is_clean_under_ruff():
    pytest.importorskip("ruff", reason="ruff comes with the `test` extra")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
