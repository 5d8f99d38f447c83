"""Progress that can be switched off (`progress=false`) without changing the loop.

On a terminal: a tqdm bar. Otherwise (a log file, Slurm, CI, a sweep's jobs): a line at 10% steps of the epoch, at most
one per 30 s, with the rate and ETA, logged through the `dprun` logger (so it is in the run's dprun.log too), so a long
job shows where it is without carriage-return noise. `progress=false`: no in-epoch output (the training loop still
logs one line per epoch with the run's ETA).
"""
from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger("dprun")


class LineProgress:
    """Iterates like tqdm; logs `desc: 40% (400/1000) 12.3 step/s, eta 0:00:49` at 10% steps, at most one line per
    `min_interval_s` (so short epochs print nothing but their epoch line)."""

    def __init__(self, iterable, desc: str = "", every: float = 0.1, min_interval_s: float = 30.0):
        self.iterable, self.desc = iterable, desc
        self.total = len(iterable) if hasattr(iterable, "__len__") else None
        self.step = max(1, int((self.total or 10) * every))
        self.min_interval_s = min_interval_s

    def __iter__(self):
        start = last = time.perf_counter()
        for i, item in enumerate(self.iterable, 1):
            yield item
            now = time.perf_counter()
            if self.total and i % self.step == 0 and now - last >= self.min_interval_s and i < self.total:
                rate = i / max(now - start, 1e-9)
                log.info("%s: %d%% (%d/%d) %.3g step/s, eta %s", self.desc, 100 * i // self.total, i, self.total, rate,
                         format_eta((self.total - i) / rate))
                last = now

    def set_postfix(self, **_):
        pass


def format_eta(seconds: float) -> str:
    seconds = int(round(max(seconds, 0)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress_bar(iterable, *, enabled: bool = True, desc: str = "", leave: bool = False):
    if enabled and not sys.stderr.isatty():
        return LineProgress(iterable, desc=desc)
    return tqdm(iterable, desc=desc, leave=leave, disable=not enabled, file=sys.stderr, dynamic_ncols=True)
