"""Shared fixtures: composing the real conf/ tree, and small run configs."""
from __future__ import annotations

import os
import subprocess
import sys
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
    suite, 2 epochs on the synthetic stand-in, 2 batches (of the setting's B=3000) an epoch and 1000 test examples.
    Use as a context manager around rendering that figure."""
    from contextlib import ExitStack
    from dataclasses import replace
    from unittest import mock

    import runner.figures.sbcd as sbcd
    import runner.paths

    def small_data(overrides, *args, **kwargs):
        if "dataset=synthetic" in overrides:
            overrides = [*overrides, "dataset.train_size=6000", "dataset.test_size=1000"]
        return compose(overrides, *args, **kwargs)

    stack = ExitStack()
    stack.enter_context(mock.patch.object(sbcd, "_adaptive_setup", lambda scale: replace(sbcd._setup(), epochs=2)))
    stack.enter_context(mock.patch.object(sbcd, "mnist_available", lambda: None))
    stack.enter_context(mock.patch.object(runner.paths, "compose", small_data))  # utility_runs' training data
    return stack


def pytest_collection_finish(session):
    """Freeze what collection made (torch, Hydra, every test module: ~430k objects) out of the cyclic garbage
    collector's reach: each epoch of a run calls gc.collect() (runner.metrics.release_free_heap, before the peak memory
    is reset), and in a test process that full collection walked them all, 0.3-0.4 s a call. What the tests make
    afterwards is collected as before; every FREEZE_EVERY tests, what is still alive between tests (modules imported
    on first use, session fixtures) is frozen too."""
    import gc

    gc.collect()
    gc.freeze()


FREEZE_EVERY = 50
_finished = [0]


def pytest_runtest_logfinish(nodeid, location):
    """After a test and its teardown: see pytest_collection_finish."""
    import gc

    _finished[0] += 1
    if _finished[0] % FREEZE_EVERY == 0:
        gc.collect()
        gc.freeze()


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def cfg_factory():
    return compose_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dprun_in_process(*args: str, cwd) -> subprocess.CompletedProcess:
    """`python -m runner.cli *args` run from cwd, but in this process: the same code from the argument list to the
    exit status (runner.cli.main, Hydra, the training), without the ~5 s a new interpreter spends importing torch
    and Hydra. For a test about what dprun says and writes (its one line, exit status, folders); a test about the
    process itself (a signal, ranks, what an import prints) starts one. -> CompletedProcess(argv, returncode,
    stdout, stderr) as subprocess.run(..., capture_output=True, text=True) gives it.

    Put back afterwards what a process would have lost at exit: sys.argv, the working folder, os.environ, the
    logging setup (Hydra's job_logging=disabled disables every existing logger; Speaker replaces the root's
    handlers), the SIGTERM/SIGINT handlers, and Hydra's global state."""
    import contextlib
    import io
    import logging
    import signal
    import traceback

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    import runner.cli as cli

    argv, cwd_before, environ = list(sys.argv), os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    root = logging.getLogger()
    root_state = (list(root.handlers), root.level, root.disabled)
    loggers = {name: (lg.disabled, lg.level, lg.propagate, list(lg.handlers))
               for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    # logging.config.dictConfig (Hydra's logging setup) closes every handler the process ever made; here those are
    # the test process's own (pytest's capture, absl's handler on pytest's stderr), which a new process would not have
    before = {id(ref) for ref in logging._handlerList}
    shutdown = logging.shutdown
    out, err = io.StringIO(), io.StringIO()
    code = 0
    GlobalHydra.instance().clear()
    cli.NEW_DIRS.clear()  # a new process starts with none
    sys.argv = [str(Path(cli.__file__)), *map(str, args)]
    os.chdir(cwd)
    logging.shutdown = lambda handlerList=None: shutdown([r for r in logging._handlerList if id(r) not in before])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as e:  # as the interpreter turns it into an exit status
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001  an uncaught error: its traceback and exit status 1
                traceback.print_exc()
                code = 1
    finally:
        logging.shutdown = shutdown
        sys.argv = argv
        os.chdir(cwd_before)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        for s, h in handlers.items():
            signal.signal(s, h)
        root.handlers[:] = root_state[0]
        root.setLevel(root_state[1])
        root.disabled = root_state[2]
        for name, lg in logging.Logger.manager.loggerDict.items():
            if not isinstance(lg, logging.Logger):
                continue
            if name in loggers:
                lg.disabled, lg.level, lg.propagate, lg.handlers[:] = loggers[name]
            else:  # made during the run: as a new logger is
                lg.disabled = False
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        cli.NEW_DIRS.clear()
    return subprocess.CompletedProcess([sys.executable, "-m", "runner.cli", *args], code, out.getvalue(),
                                       err.getvalue())
