"""CIFAR-10 from the official BINARY release, shape (N, 3, 32, 32); never unpickles unless allowed.

    dprun dataset=cifar10 data_dir=~/data              # ~/data/cifar10/cifar-10-batches-bin/*.bin or the tarball
    dprun dataset=cifar10 dataset.download=true        # fetch cifar-10-binary.tar.gz (md5-checked), read it in place
    dprun dataset=cifar10 dataset.allow_pickle=true    # also accept the python version (pickle can run code)

Sources tried, in each of <data_dir>/cifar10, <data_dir>/cifar-10, <data_dir>: the folder cifar-10-batches-bin/
(data_batch_1..5.bin, test_batch.bin), the folder itself holding those .bin files, the tarball
cifar-10-binary.tar.gz (read without extracting); with allow_pickle=true also cifar-10-batches-py/ and
cifar-10-python.tar.gz. A binary record is 1 label byte then 3,072 pixel bytes (1,024 R, 1,024 G, 1,024 B, rows
of 32). Normalisation: the per-channel mean/std of the CIFAR-10 training set, (0.4914, 0.4822, 0.4465) /
(0.2470, 0.2435, 0.2616) -- the population std over all training pixels, not the mean of per-image stds
(0.2023, 0.1994, 0.2010) that some code bases copy. These are the published constants, fixed here, not statistics
of the files that are loaded. Integrity: every batch must hold 10,000 images, a tarball must decompress to its end
(gzip CRC) and read as a tar archive; each failure is one line naming the file (runner/data/integrity.py).
"""
from __future__ import annotations

import pickle
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from runner.data.base import DATASETS, DataInfo, Dataset, normalised_range
from runner.data.download import fetch, missing_files
from runner.data.integrity import GZIP_ERRORS, check_count, check_gzip_stream
from runner.errors import DprunError

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
TEST = ["test_batch"]
SUBDIRS = ("cifar10", "cifar-10")
BIN_DIR, PY_DIR = "cifar-10-batches-bin", "cifar-10-batches-py"
BIN_TAR, PY_TAR = "cifar-10-binary.tar.gz", "cifar-10-python.tar.gz"
BIN_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
MIRRORS = ["https://www.cs.toronto.edu/~kriz/"]
RECORD = 1 + 3 * 32 * 32  # bytes per image in the binary version
PER_BATCH = 10000  # images in each of the 5 training batches and the test batch
FIX = "delete it and download cifar-10-binary.tar.gz again (dataset.download=true) or extract it again"


def parse_binary(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Binary batch bytes -> (N, 3, 32, 32) uint8 images and (N,) labels."""
    if len(raw) % RECORD:
        raise DprunError(f"{where} has {len(raw)} bytes, not a multiple of the {RECORD}-byte CIFAR-10 record")
    rec = np.frombuffer(raw, np.uint8).reshape(-1, RECORD)
    return rec[:, 1:].reshape(-1, 3, 32, 32), rec[:, 0]


def parse_pickle(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Python-version batch (a pickled dict; only reached with allow_pickle=true) -> images and labels."""
    d = pickle.loads(raw, encoding="bytes")
    return np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"labels"], np.uint8)


def folder_reader(folder: Path, suffix: str) -> Callable[[str], bytes] | None:
    if all((folder / (n + suffix)).is_file() for n in TRAIN + TEST):
        return lambda n: (folder / (n + suffix)).read_bytes()
    return None


def tar_reader(path: Path, inner: str, suffix: str) -> Callable[[str], bytes]:
    check_gzip_stream(path, FIX)  # tarfile stops without an error at a garbled header: check the CRC first
    try:
        with tarfile.open(path) as tar:  # read every batch once; the binary tarball is 163 MB
            files = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read() for m in tar.getmembers()
                     if m.isfile() and m.name.startswith(inner + "/")}
    except (tarfile.TarError, *GZIP_ERRORS) as e:
        reason = f"{type(e).__name__}: {(str(e) or 'corrupt').splitlines()[0]}"
        raise DprunError(f"{path} is a damaged tar archive ({reason}); {FIX}") from None
    missing = [n + suffix for n in TRAIN + TEST if n + suffix not in files]
    if missing:
        raise DprunError(f"{path} lacks {inner}/{missing[0]}: not the official CIFAR-10 tarball")
    return lambda n: files[n + suffix]


def find_source(root: Path, allow_pickle: bool):
    """-> (reader(batch name) -> bytes, parser, description) for the first source found, else None."""
    for base in [root / s for s in SUBDIRS] + [root]:
        for folder in (base / BIN_DIR, base):
            if reader := folder_reader(folder, ".bin"):
                return reader, parse_binary, str(folder)
        if (base / BIN_TAR).is_file():
            return tar_reader(base / BIN_TAR, BIN_DIR, ".bin"), parse_binary, str(base / BIN_TAR)
        if allow_pickle:
            for folder in (base / PY_DIR, base):
                if reader := folder_reader(folder, ""):
                    return reader, parse_pickle, str(folder)
            if (base / PY_TAR).is_file():
                return tar_reader(base / PY_TAR, PY_DIR, ""), parse_pickle, str(base / PY_TAR)
    return None


def has_pickled(root: Path) -> Path | None:
    for base in [root / s for s in SUBDIRS] + [root]:
        for p in (base / PY_DIR, base / PY_TAR):
            if p.exists():
                return p
    return None


@DATASETS.register("cifar10")
def load_cifar10(cfg, root) -> Dataset:
    root = Path(root)
    allow_pickle = bool(cfg.get("allow_pickle", False))
    source = find_source(root, allow_pickle)
    if source is None and cfg.get("download", False):
        fetch(BIN_TAR, MIRRORS, root / SUBDIRS[0], md5=BIN_MD5)
        source = find_source(root, allow_pickle)
    if source is None:
        pickled = has_pickled(root)
        extra = (f" (found the pickled python version {pickled}: it is read only with dataset.allow_pickle=true, "
                 f"since unpickling can run code)" if pickled else "")
        raise missing_files("cifar10", [f"{BIN_DIR}/{{{','.join(TRAIN + TEST)}}}.bin or {BIN_TAR}"],
                            root / SUBDIRS[0], extra)
    reader, parse, where = source

    def split(names):  # -> (N, 3, 32, 32) float32 standardised per channel, (N,) int64
        suffix = ".bin" if parse is parse_binary else ""  # name the file itself in errors
        parts = [parse(reader(n), f"{where}/{n}{suffix}") for n in names]
        for n, (images, _) in zip(names, parts):
            check_count(f"{where}/{n}{suffix}", "images", len(images), PER_BATCH, FIX)
        x = torch.from_numpy(np.concatenate([p[0] for p in parts]).astype(np.float32)) / 255.0
        y = torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.int64))
        if y.numel() and int(y.max()) > 9:
            raise DprunError(f"{where} has label {int(y.max())}; CIFAR-10 labels are 0..9 (is this CIFAR-100?)")
        return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1), y

    (xtr, ytr), (xte, yte) = split(TRAIN), split(TEST)
    info = DataInfo("cifar10", (3, 32, 32), 10, train_size=len(ytr), test_size=len(yte),
                    input_range=normalised_range(MEAN, STD))
    return Dataset(info, xtr, ytr, xte, yte, source="real", extras={"folder": where})
