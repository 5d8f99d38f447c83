"""Ending a run from outside: Ctrl-C and SIGTERM (what `timeout`, `kill` and Slurm send) stop it cleanly.

    with sigterm_as_interrupt():      # SIGTERM raises Terminated, a KeyboardInterrupt: the training loop records
        train(cfg, out_dir)           # status `interrupted` and the epochs completed, as it does for Ctrl-C
    line, code = interrupted_exit(e, out_dir)   # "dprun: interrupted; 3 complete epochs kept in <dir>", 130 or 143

Without the handler SIGTERM kills the process on the spot and summary.json says `running` forever.
"""
from __future__ import annotations

import csv
import json
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread. A KeyboardInterrupt so that every `except KeyboardInterrupt` that
    records an interruption (runner/train.py) treats both signals alike."""


def _raise_terminated(signum, frame):
    # one-shot: a second SIGTERM while summary.json is being written would cut that write short; SIGKILL still works
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises Terminated while the block runs; the previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait while the block runs: the run's last records (runner/train.py finish: the saved epoch
    published, summary.json written), which a second Ctrl-C cut short, leaving summary.json an epoch behind
    checkpoint.pt (review 39). One that arrived is raised as the block ends, unless the run is already ending by an
    exception (the first Ctrl-C's, whose exit status it keeps). SIGKILL still ends the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in held}
    for s in held:
        if previous[s] != signal.SIG_IGN:  # an ignored one (a second SIGTERM) stays ignored
            signal.signal(s, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, previous[s] if previous[s] is not None else signal.SIG_DFL)
    if arrived and sys.exc_info()[0] is None:
        raise Terminated() if arrived[0] == signal.SIGTERM else KeyboardInterrupt()


def epochs_kept(out_dir: str | Path) -> int:
    """The complete epochs on disk: summary.json's epochs_completed, or metrics.csv's rows where that is more (a
    summary.json whose final write failed, a full disk, still says what it said when the run started)."""
    try:
        summary = int(json.loads((Path(out_dir) / "summary.json").read_text()).get("epochs_completed", 0))
    except (OSError, ValueError, AttributeError, TypeError):  # interrupted before the first summary was written
        summary = 0
    try:
        with open(Path(out_dir) / "metrics.csv", newline="") as f:
            rows = sum(1 for _ in csv.DictReader(f))
    except (OSError, ValueError, csv.Error):
        rows = 0
    return max(summary, rows)


def interrupted_exit(exc: KeyboardInterrupt, out_dir: str | Path) -> tuple[str, int]:
    """(the one line to print, the exit status): 128 + the signal number, as a shell reports a killed job."""
    n = epochs_kept(out_dir)
    what, code = ("terminated (SIGTERM)", 128 + signal.SIGTERM) if isinstance(exc, Terminated) else \
        ("interrupted", 128 + signal.SIGINT)
    return f"dprun: {what}; {n} complete epoch{'s' if n != 1 else ''} kept in {out_dir}", int(code)
