"""Data integrity: the known checksums of the standard files, damaged-gzip errors, expected counts. One line each.

    raw = gunzip(path)                                   # EOFError / BadGzipFile / zlib.error -> one-line DprunError
    check_known(path, "mnist", raw=raw)                  # content sha256 against the table, when the name is known
    check_gzip_stream(path)                              # a tarball's gzip CRC, read to the end
    check_count(path, "train/pos reviews", 800, 12500, fix)

Why: a damaged archive can decode without any exception (tarfile stops silently at a garbled header, so a
tarball with 64 flipped bytes yielded 800 reviews of one class), and a model trained on it reports an accuracy and
an epsilon as if nothing happened. Every loader therefore checks what it can: the checksum of a standard file
(known by its name), the gzip CRC, the idx header, and the number of examples the release is known to hold.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path

from runner.errors import DprunError

CHUNK = 1 << 20  # bytes per read

# (dataset, file name) -> sha256. idx files: the sha256 of the DECOMPRESSED idx bytes, so a raw (gunzipped) copy
# and a re-gzipped copy are checked too; computed from files whose .gz md5 equals torchvision's list.
# Tarballs: the sha256 of the file itself.
KNOWN_SHA256 = {
    ("mnist", "train-images-idx3-ubyte"): "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    ("mnist", "train-labels-idx1-ubyte"): "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    ("mnist", "t10k-images-idx3-ubyte"): "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    ("mnist", "t10k-labels-idx1-ubyte"): "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    ("fmnist", "train-images-idx3-ubyte"): "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    ("fmnist", "train-labels-idx1-ubyte"): "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    ("fmnist", "t10k-images-idx3-ubyte"): "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    ("fmnist", "t10k-labels-idx1-ubyte"): "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    # the Stanford release (84,125,825 bytes) and the labelled-only repack shipped in /work/shared/data/imdb
    ("imdb", "aclImdb_v1.tar.gz"): "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe",
    ("imdb", "aclImdb_labeled_text.tar.gz"): "0ed80b97dc02bab4bf405bc1818f80e0a2d818cb5bb8080539c0147c307b1a55",
}

# what reading a damaged .gz raises: truncated (EOFError), bad header or CRC (BadGzipFile), bad deflate (zlib.error)
GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def known_sha256(dataset: str, path: Path) -> str | None:
    """The expected sha256 for a standard file name (".gz" stripped for idx files), else None."""
    name = path.name
    return KNOWN_SHA256.get((dataset, name)) or KNOWN_SHA256.get((dataset, name.removesuffix(".gz")))


def check_known(path: Path, dataset: str, fix: str, raw: bytes | None = None, digest: str | None = None) -> None:
    """A file with a standard name must have the standard content. `raw`: hash these (decompressed) bytes instead of
    the file; `digest`: an already computed sha256. Unknown names pass (their counts are checked elsewhere)."""
    expected = known_sha256(dataset, path)
    if expected is None:
        return
    got = digest or (hashlib.sha256(raw).hexdigest() if raw is not None else sha256_file(path))
    if got != expected:
        other = [d for (d, n), h in KNOWN_SHA256.items() if h == got and d != dataset]
        if other:  # e.g. dataset=fmnist with data_dir at the MNIST folder: same file names, other content
            raise DprunError(f"{path} is the {other[0]} file, not {dataset}'s: is data_dir pointing at another "
                             f"dataset's folder?")
        what = "content " if raw is not None else ""
        raise DprunError(f"{path} has {what}sha256 {got[:16]}..., the standard {path.name} has {expected[:16]}...: "
                         f"the file is damaged or altered; {fix}")


def gunzip(path: Path, fix: str) -> bytes:
    """The decompressed bytes of a .gz file; a truncated or corrupted one is a one-line error naming it."""
    try:
        return gzip.decompress(path.read_bytes())
    except GZIP_ERRORS as e:
        raise DprunError(f"{path} is a damaged gzip file ({damage(e)}); {fix}") from None


def check_gzip_stream(path: Path, fix: str) -> None:
    """Decompress a (large) .gz to its end without keeping it: the gzip trailer's CRC and length are verified."""
    try:
        with gzip.open(path, "rb") as f:
            while f.read(CHUNK):
                pass
    except GZIP_ERRORS as e:
        raise DprunError(f"{path} is a damaged gzip file ({damage(e)}); {fix}") from None


def damage(e: Exception) -> str:
    """A short reason for a gzip error, on one line (EOFError's message is a whole sentence)."""
    if isinstance(e, EOFError):
        return "truncated: it ends before the end of the compressed data"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'corrupt data'}"


def check_count(where: Path | str, what: str, got: int, expected: int, fix: str) -> None:
    if got != expected:
        raise DprunError(f"{where} holds {got:,} {what}, the release has {expected:,}: the data is incomplete or "
                         f"damaged; {fix}")
