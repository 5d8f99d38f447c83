"""Timers (CUDA-synchronised), peak memory, and crash-safe CSV/JSON writers.

Writers replace the whole file through a temporary file + os.replace, so an interrupted run leaves the previous
complete version (only complete rows), never a half-written line, and no temporary file. JSON is standard JSON:
an infinite or NaN float is written as null (see json_safe).
"""
from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time of one step, CUDA-synchronised at both ends so the GPU's queued work is counted.
    enabled=False: no sync and no time (step_timing=epoch: the GPU runs ahead of Python)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        self.seconds = float("nan")

    def __enter__(self):
        if self.enabled:
            synchronize(self.device)
            self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            synchronize(self.device)
            self.seconds = time.perf_counter() - self.start


def _proc_peak_rss() -> int | None:
    """Linux: the process's peak resident set size since the last reset (VmHWM in /proc/self/status), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """CUDA: reset the allocator's peak. CPU (Linux): reset the process's peak RSS to its current RSS by writing 5
    to /proc/self/clear_refs, so each epoch (and each job of a multirun) measures its own peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    release_free_heap()  # else the heap an earlier job freed but malloc kept would count in this one's peak
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux (or not allowed): peak_memory_bytes falls back to the process-wide maximum


def release_free_heap() -> None:
    """Collect unreachable objects and hand malloc's free pages back to the OS (glibc's malloc_trim), so that the
    resident set is the memory in use. Without glibc (macOS, Windows) only the collection happens."""
    import gc

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # no such symbol (macOS, musl), no CDLL(None) (Windows)
        return None


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated since the last reset. CPU: the process's peak resident set size since the last reset
    (Linux; it includes the data held in memory and torch's own baseline, not only the step's tensors); where the
    peak cannot be reset (macOS), the process's maximum RSS since it started."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _proc_peak_rss()
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def atomic_replace(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """write(tmp) into a temp file beside `path`, then os.replace: readers see the old file or the new one. A write
    that fails (a full disk) leaves the old file as it was, and its OSError names `path` (a failed write() names no
    file, and the temp file's name would mislead)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:  # full disk: never leave a half-written temp file behind
        tmp.unlink(missing_ok=True)
        if e.filename in (None, str(tmp), tmp):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e  # "[Errno 28] No space ...: 'path'"
        raise
    except BaseException:  # SIGTERM, Ctrl-C: never leave a half-written temp file behind
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    atomic_replace(path, write)


def write_csv(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> None:
    rows = list(rows)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def json_safe(obj: Any) -> Any:
    """obj with every infinite or NaN float replaced by None: JSON has no Infinity/NaN (json.dumps would write
    them as bare tokens that strict parsers reject). An infinite epsilon keeps its meaning through the
    `epsilon_lower_bound` field the accountant writes next to it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    return json.dumps(json_safe(obj), indent=2, sort_keys=False, default=str, allow_nan=False) + "\n"


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json_text(obj))


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0], "torch": torch.__version__}  # with its build tag (+cpu, +cu130)
    for name in ("dprun", "hydra-core", "dp-accounting", "opacus", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
