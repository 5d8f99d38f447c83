"""Random tensors with the shapes and class count of another dataset, for timing: no files needed.

    dprun dataset=synthetic dataset.like=cifar10            # (3, 32, 32), 10 classes, N=50,000
    dprun dataset=synthetic dataset.like=imdb                # 150 token ids < 8,185, 2 classes
    dprun dataset=synthetic dataset.like=lsun dataset.image_size=256   # (3, 256, 256), 10 classes

`dataset.train_size` / `dataset.test_size` override N (default: the real dataset's sizes, so that the sample
rate and steps per epoch match the paper). Labels are uniform; accuracy on this data is chance by design.
"""
from __future__ import annotations

import torch

from runner.data.base import DATASETS, DataInfo, Dataset
from runner.errors import DprunError
from runner.randomness import derived_seed
from runner.registry import unknown_name_message

# name -> (input_shape, num_classes, kind, vocab_size, train_size, test_size)
LIKE = {
    "mnist": ((1, 28, 28), 10, "image", None, 60000, 10000),
    "fmnist": ((1, 28, 28), 10, "image", None, 60000, 10000),
    "cifar10": ((3, 32, 32), 10, "image", None, 50000, 10000),
    "digits": ((1, 8, 8), 10, "image", None, 1437, 360),
    "imdb": ((150,), 2, "text", 8185, 25000, 25000),
    "lsun": ((3, 64, 64), 10, "image", None, 10000, 1000),  # L&K figure 8: LSUN-shaped images, size via image_size
}


def like_info(like: str) -> DataInfo:
    """The shapes of dataset `like` (above) as its DataInfo: what the benchmarks draw their inputs with."""
    shape, classes, kind, vocab, n_train, n_test = LIKE[like]
    return DataInfo(like, shape, classes, kind, vocab, n_train, n_test)


@DATASETS.register("synthetic")
def load_synthetic(cfg, root) -> Dataset:
    like = cfg.get("like", "cifar10")
    if like not in LIKE:
        raise DprunError(unknown_name_message("dataset.like", like, sorted(LIKE)))
    shape, classes, kind, vocab, n_train, n_test = LIKE[like]
    if kind == "image" and cfg.get("image_size"):
        shape = (shape[0], int(cfg.image_size), int(cfg.image_size))
    if kind == "text" and cfg.get("seq_len"):
        shape = (int(cfg.seq_len),)
    n_train = int(cfg.get("train_size") or n_train)
    n_test = int(cfg.get("test_size") or n_test)
    g = torch.Generator().manual_seed(derived_seed(int(cfg.get("seed", 0)), "synthetic-data"))  # not the noise's stream

    def draw(n):
        x = torch.randint(1, vocab, (n, *shape), generator=g) if kind == "text" else torch.randn(n, *shape, generator=g)
        return x, torch.randint(0, classes, (n,), generator=g)

    info = DataInfo(f"synthetic-{like}", shape, classes, kind, vocab, n_train, n_test)
    (xtr, ytr), (xte, yte) = draw(n_train), draw(n_test)
    return Dataset(info, xtr, ytr, xte, yte, source="synthetic", extras={"like": like})
