"""One writer per run folder: a running dprun holds <folder>/dprun.lock, so `dprun resume=<folder>` (or a second run
with the same out_dir=) while it runs is refused in one line instead of two processes writing one folder.

    with holding("outputs/runs/x"):    # InUse: "run /.../outputs/runs/x is in use by pid 123 on host gpu01"
        train(...)
    alive(pid, host)                   # True / False on this host; None where the host is another one

The lock is fcntl.flock on dprun.lock, which also records the holder's pid and host (for the message). The kernel
drops a flock when its process dies, however it dies (SIGKILL, the OOM killer), so a lock left behind never blocks a
resume; the file is removed when the run ends. Re-entrant within a process (the CLI takes it before the run's log is
opened, train() again for callers of the Python API).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from runner.errors import DprunError

FILE = "dprun.lock"
_held: dict[Path, list] = {}  # resolved folder -> [fd, depth]: this process's locks


class InUse(DprunError):
    """Another process holds the folder's lock: nothing of the folder may be touched (not even a refused run's
    clean-up)."""


def host() -> str:
    return socket.gethostname()


def alive(pid: int, on_host: str | None) -> bool | None:
    """Whether process pid runs: True / False on this host, None (cannot tell) on another host or without one."""
    if not on_host or on_host != host():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _recorded(path: Path) -> tuple[int | None, str]:
    try:
        owner = json.loads(path.read_text())
        return int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):  # just created, not yet written
        return None, "?"


def take(folder: str | Path) -> None:
    """Lock folder (created if missing) for this process, or raise InUse naming the holder."""
    folder = Path(folder).resolve()
    if folder in _held:
        _held[folder][1] += 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # an existing file is opened as it is, not truncated
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise DprunError(f"run {folder}: cannot lock {path} ({os.strerror(e.errno)}); this file system "
                                 f"does not support file locks") from e
            pid, where = _recorded(path)
            raise InUse(f"run {folder} is in use by pid {pid if pid is not None else '?'} on host {where}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # its holder removed it between our open and flock
            same = False
        if same:
            break
        os.close(fd)  # a lock on a removed file guards nothing: take the current one
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": host()}).encode())
    _held[folder] = [fd, 1]


def release(folder: str | Path) -> None:
    """Undo one take(); the last one removes the lock file (while still holding it, so that no one locks a file
    that is about to disappear)."""
    folder = Path(folder).resolve()
    if folder not in _held:
        return
    _held[folder][1] -= 1
    if _held[folder][1] > 0:
        return
    fd, _ = _held.pop(folder)
    try:
        (folder / FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)  # closing drops the flock


@contextmanager
def holding(folder: str | Path):
    """take() for the block; released on any exit (an exception, Ctrl-C, SIGTERM raised as Terminated)."""
    take(folder)
    try:
        yield
    finally:
        release(folder)
