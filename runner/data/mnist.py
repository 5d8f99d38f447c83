"""MNIST and Fashion-MNIST from the standard idx files (gzipped or raw), shape (N, 1, 28, 28).

    dprun dataset=mnist data_dir=/work/shared/data        # reads /work/shared/data/mnist/*-ubyte[.gz]
    dprun dataset=fmnist data_dir=~/data/fashion-mnist    # data_dir may also be the folder with the files
    dprun dataset=mnist dataset.download=true             # fetch the official files (md5-checked) first

Folders searched, in order: <data_dir>/mnist (fmnist: <data_dir>/fashion-mnist, <data_dir>/fmnist), then
<data_dir> itself. Pixels are scaled to [0, 1] and standardised with the fixed constants the papers use
(MNIST mean 0.1307 std 0.3081; Fashion-MNIST mean 0.2860 std 0.3530). Labels are int64 in 0..9.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.data.base import DATASETS, DataInfo, Dataset, normalised_range
from runner.data.download import fetch, missing_files
from runner.data.integrity import check_count, check_known, gunzip
from runner.errors import DprunError

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# name -> (sub-folders of data_dir, (mean, std), download mirrors, md5 of each .gz file in FILES order)
SPECS = {
    "mnist": (("mnist",), (0.1307, 0.3081),
              ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"],
              ("f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432",
               "9fb629c4189551a2d022fa330f9573f3", "ec29112dd5afa0611ce80d1b7f02629c")),
    "fmnist": (("fashion-mnist", "fmnist"), (0.2860, 0.3530),
               ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
               ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe",
                "bef4ecab320f06d8554ea6380940ec79", "bb300cfdad3c16e7a12a480ee83cd310")),
}


# idx magic numbers: 0x0000 then type 0x08 (unsigned byte) then the number of dims (3 images, 1 labels)
MAGIC = {"images": b"\x00\x00\x08\x03", "labels": b"\x00\x00\x08\x01"}
COUNTS = {"train": 60000, "t10k": 10000}  # examples per split in both releases


def read_idx(path: Path, name: str = "mnist", fix: str = "") -> np.ndarray:
    """An idx file of unsigned bytes (gzip detected from its magic bytes) -> uint8 array of its dims, after
    checking the gzip CRC, the idx magic for its kind (images/labels), the data length, the standard content
    (sha256, when the file has a standard name) and the example count of its split. Each failure: one line."""
    fix = fix or f"delete it and download it again (dataset.download=true) or copy the original into {path.parent}"
    raw = path.read_bytes()
    if not raw:
        raise DprunError(f"{path} is empty (0 bytes); {fix}")
    if raw[:2] == b"\x1f\x8b":
        raw = gunzip(path, fix)
    kind = "images" if "-images-" in path.name else "labels"
    if raw[:4] != MAGIC[kind]:
        raise DprunError(f"{path} is not an idx file of unsigned bytes holding {kind} (header {raw[:4].hex()}, "
                         f"expected {MAGIC[kind].hex()}); {fix}")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(dims)):
        raise DprunError(f"{path} holds {len(raw) - offset} bytes of data, its header says {dims}: truncated "
                         f"file; {fix}")
    check_count(path, kind, dims[0], COUNTS[path.name.split("-")[0]], fix)  # first: the clearer message
    check_known(path, name, fix, raw=raw)
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(dims)


def find_file(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def find_folder(root: Path, subdirs: tuple[str, ...]) -> Path | None:
    for folder in [root / s for s in subdirs] + [root]:
        if all(find_file(folder, stem) for stem in FILES):
            return folder
    return None


def nearest_folder(root: Path, subdirs: tuple[str, ...]) -> Path:
    """The searched folder holding most of FILES (the first on a tie): where a missing-files message points."""
    return max([root / s for s in subdirs] + [root], key=lambda f: sum(bool(find_file(f, stem)) for stem in FILES))


def load_idx_dataset(name: str, cfg, root: Path) -> Dataset:
    subdirs, (mean, std), mirrors, md5s = SPECS[name]
    folder = find_folder(root, subdirs)
    if folder is None and cfg.get("download", False):
        folder = root / subdirs[0]
        for stem, md5 in zip(FILES, md5s):
            if not find_file(folder, stem):
                fetch(stem + ".gz", mirrors, folder, md5=md5)
    if folder is None:
        near = nearest_folder(root, subdirs)
        raise missing_files(name, [s + "[.gz]" for s in FILES if not find_file(near, s)], near)
    xtr, ytr, xte, yte = (read_idx(find_file(folder, stem), name) for stem in FILES)
    if xtr.shape[1:] != (28, 28) or len(xtr) != len(ytr) or len(xte) != len(yte):
        raise DprunError(f"{name} files in {folder} have images {xtr.shape}/{xte.shape} and labels "
                         f"{ytr.shape}/{yte.shape}; expected (N, 28, 28) images with N labels")
    if len(xtr) == 60000 and abs(xtr.mean() / 255 - mean) > 0.02:  # e.g. data_dir pointing at the other dataset
        raise DprunError(f"the files in {folder} have pixel mean {xtr.mean() / 255:.4f}, but {name} has {mean}: "
                         f"is data_dir pointing at another dataset's folder?")

    def images(a):  # (N, 28, 28) uint8 -> (N, 1, 28, 28) float32, standardised
        return ((torch.from_numpy(a.astype(np.float32)) / 255.0 - mean) / std).unsqueeze(1)

    info = DataInfo(name, (1, 28, 28), 10, train_size=len(ytr), test_size=len(yte),
                    input_range=normalised_range(mean, std))
    return Dataset(info, images(xtr), torch.from_numpy(ytr.astype(np.int64)), images(xte),
                   torch.from_numpy(yte.astype(np.int64)), source="real", extras={"folder": str(folder)})


@DATASETS.register("mnist")
def load_mnist(cfg, root) -> Dataset:
    return load_idx_dataset("mnist", cfg, Path(root))


@DATASETS.register("fmnist")
def load_fmnist(cfg, root) -> Dataset:
    return load_idx_dataset("fmnist", cfg, Path(root))
