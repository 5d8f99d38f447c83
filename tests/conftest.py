"""Shared fixtures: composing the real conf/ tree, and small run configs."""
from __future__ import annotations

import os
from pathlib import Path

# pytest-xdist runs one worker per core: one thread per worker and per subprocess it starts (OMP_NUM_THREADS is read
# when torch is imported), else the workers' thread pools fight over the cores (8:20 -> 7:16 on 2 cores)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from runner.paths import compose, register_resolvers  # noqa: E402

register_resolvers()  # the resolvers conf/ uses

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
# the tests' subprocesses (`python -m runner.cli` from a tmp folder) import runner from this checkout, not from the
# checkout the venv's editable install points at: run from a git worktree, they would otherwise test other code
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def shared_data() -> Path:
    """The real datasets the real-data tests read (never modify; they skip where a dataset is absent): $DPRUN_DATA_DIR
    when set, as for dprun itself, else ../shared/data beside the checkout (or beside the worktrees' folder)."""
    if os.environ.get("DPRUN_DATA_DIR"):
        return Path(os.environ["DPRUN_DATA_DIR"]).expanduser()
    beside = [ROOT.parent / "shared" / "data", ROOT.parents[1] / "shared" / "data"]
    return next((p for p in beside if p.is_dir()), beside[0])


SHARED_DATA = shared_data()


def compose_config(overrides: list[str] | None = None):
    """conf/config.yaml composed with overrides, as `dprun k=v ...` would see it (no Hydra run dir)."""
    return compose(overrides or [])


def small_adaptive_noise():
    """sbcd_adaptive_noise trains one DP-SBCD run per schedule (minutes on real MNIST at smoke scale): in the fast
    suite, 2 epochs on the synthetic stand-in. Use as a context manager around rendering that figure."""
    from contextlib import ExitStack
    from dataclasses import replace
    from unittest import mock

    import runner.figures.sbcd as sbcd

    stack = ExitStack()
    stack.enter_context(mock.patch.object(sbcd, "_adaptive_setup", lambda scale: replace(sbcd._setup(), epochs=2)))
    stack.enter_context(mock.patch.object(sbcd, "mnist_available", lambda: None))
    return stack


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def cfg_factory():
    return compose_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
