"""Fetch official dataset files with urllib, verify their checksum, and the one-line "files missing" error.

    fetch("train-labels-idx1-ubyte.gz", MNIST_MIRRORS, folder, md5="d53e105ee54ea40749a09fcbcd1e9432")
    raise missing_files("mnist", ["train-images-idx3-ubyte[.gz]", ...], folder)

A download is streamed to `<name>.part`, hashed while it streams, and renamed into place only when the checksum
matches, so an interrupted or corrupted download never looks like a good file. Mirrors are tried in order.
`URLOPEN` is module-level so that tests can replace the network with a local opener.
"""
from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from pathlib import Path

from runner.errors import DprunError

URLOPEN = urllib.request.urlopen
CHUNK = 1 << 20  # bytes per read


def file_digest(path: str | os.PathLike, algorithm: str = "md5") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: str | os.PathLike, md5: str | None = None, sha256: str | None = None) -> None:
    """Raise a one-line DprunError when the file's md5/sha256 differs from the expected one."""
    for algorithm, expected in (("md5", md5), ("sha256", sha256)):
        if expected and (got := file_digest(path, algorithm)) != expected.lower():
            raise DprunError(f"{path} has {algorithm} {got}, expected {expected}: the file is corrupt or a "
                             f"different release; delete it and download again")


def fetch(name: str, urls: list[str], folder: str | os.PathLike, md5: str | None = None,
          sha256: str | None = None, timeout: float = 60.0) -> Path:
    """Download `name` from the first mirror in `urls` (each a base URL ending in '/') that serves it with the
    expected checksum; return the file's path in `folder`. An existing file is kept after checking it."""
    folder = Path(folder)
    dest = folder / name
    if dest.exists():
        verify(dest, md5, sha256)
        return dest
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DprunError(f"cannot create {folder} for the download ({e.strerror}); set data_dir to a writable folder")
    part = dest.with_name(name + ".part")
    reason = "no mirror"
    for base in urls:
        url = base + name
        try:
            hashes = {"md5": hashlib.md5(), "sha256": hashlib.sha256()}
            with URLOPEN(url, timeout=timeout) as response, open(part, "wb") as out:
                for block in iter(lambda: response.read(CHUNK), b""):
                    out.write(block)
                    for h in hashes.values():
                        h.update(block)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = f"{url} not reachable: {getattr(e, 'reason', None) or e}"
            part.unlink(missing_ok=True)
            continue
        bad = [f"{a} {hashes[a].hexdigest()} != expected {want}" for a, want in (("md5", md5), ("sha256", sha256))
               if want and hashes[a].hexdigest() != want.lower()]
        if bad:
            reason = f"{url} served a file with {bad[0]}"
            part.unlink(missing_ok=True)
            continue
        os.replace(part, dest)
        return dest
    raise DprunError(f"could not download {name} ({reason}); without internet, copy {name} into {folder} by hand")


def missing_files(dataset: str, files: list[str], folder: str | os.PathLike, extra: str = "") -> DprunError:
    """The one-line error for absent data files: which files, which folder, and how to download them."""
    return DprunError(f"{dataset}: missing {', '.join(files)} in {folder}{extra}; put them there "
                      f"(or point data_dir at the folder holding them) or run with dataset.download=true")
