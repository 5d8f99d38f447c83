"""Datasets as tensors on the run's device, loaded once. One file per dataset family registers in DATASETS.

    data = load_dataset(cfg.dataset, data_dir="~/.cache/dprun", device="cpu")
    data.train_x[idx], data.train_y[idx]     # batches are index gathers, no DataLoader

Each loader is `fn(cfg, data_dir) -> Dataset` with tensors on the CPU; `load_dataset` moves them to the device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from runner.data_dir import default_data_dir  # noqa: F401  (re-exported: runner.data's public name)

from runner.registry import Registry

DATASETS = Registry("dataset")


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its input. Images: input_shape (C, H, W); text: (seq_len,) of token ids."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    kind: str = "image"  # "image" | "text"
    vocab_size: int | None = None  # text only
    train_size: int = 0
    test_size: int = 0
    # images: the least and greatest value an input can take after the loader's fixed normalisation (pixels 0..1):
    # public, unlike the training set's own min and max (audit canaries are drawn over it); None: not known
    input_range: tuple[float, float] | None = None


def normalised_range(mean, std) -> tuple[float, float]:
    """(lo, hi) of (pixel - mean) / std over pixels in [0, 1] and every channel's (mean, std)."""
    pairs = list(zip(mean, std)) if isinstance(mean, (tuple, list)) else [(mean, std)]
    return min(-m / s for m, s in pairs), max((1 - m) / s for m, s in pairs)


@dataclass
class Dataset:
    info: DataInfo
    train_x: torch.Tensor  # (N, *input_shape) float32 images (normalised) or int64 token ids
    train_y: torch.Tensor  # (N,) int64
    test_x: torch.Tensor
    test_y: torch.Tensor
    source: str = "real"  # "real" | "synthetic" (a column of the result tables)
    extras: dict[str, Any] = field(default_factory=dict)
    # what the data pipeline does with private data outside the privacy accounting (e.g. a tokenizer fit to the
    # training split): the training loop copies these into summary.json; empty when nothing is outside
    privacy_notes: list[str] = field(default_factory=list)

    def to(self, device: torch.device | str) -> "Dataset":
        return replace(self, train_x=self.train_x.to(device), train_y=self.train_y.to(device),
                       test_x=self.test_x.to(device), test_y=self.test_y.to(device))


def load_dataset(cfg: Any, data_dir: str | os.PathLike | None, device: torch.device | str = "cpu") -> Dataset:
    name = cfg["name"] if isinstance(cfg, dict) else cfg.name
    root = Path(os.path.expanduser(str(data_dir or default_data_dir())))
    data = DATASETS.build(name, cfg, root)
    return data.to(device)
