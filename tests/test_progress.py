"""Progress off a terminal (a log file, Slurm, a sweep's jobs): lines with the ETA through the `dprun` logger, so
they reach the run's dprun.log as well as stderr."""
from __future__ import annotations

import io
import logging

from runner import progress


def test_off_a_terminal_progress_is_lines_with_the_eta_in_the_log(caplog, monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())  # not a terminal
    bar = progress.progress_bar(range(20), desc="epoch 1/3")
    assert isinstance(bar, progress.LineProgress)
    bar.min_interval_s = 0  # (30 s by default: short epochs print only their epoch line)
    with caplog.at_level(logging.INFO, logger="dprun"):
        assert list(bar) == list(range(20))
    lines = [r.getMessage() for r in caplog.records if r.name == "dprun"]
    assert len(lines) == 9  # at 10%, 20%, ..., 90%
    assert lines[0].startswith("epoch 1/3: 10% (2/20) ") and all(", eta 0:00:0" in line for line in lines)


def test_progress_false_prints_nothing_in_the_epoch(caplog, monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="dprun"):
        assert list(progress.progress_bar(range(20), enabled=False)) == list(range(20))
    assert not caplog.records
