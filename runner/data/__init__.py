"""Datasets as on-device tensors (runner.data.base) and samplers (runner.data.sampler)."""
from __future__ import annotations

from runner.data import cifar10, digits, imdb, mnist, synthetic  # noqa: F401  (each registers in DATASETS)
from runner.data.base import DATASETS, DataInfo, Dataset, default_data_dir, load_dataset  # noqa: F401
