"""scikit-learn's bundled 8x8 digits (1,797 images): real data that works offline. Used by the demo and tests.

Split: a fixed stratified 80/20 train/test split (seed 0). Pixels (0..16) scaled to [0, 1], then standardised
with the training mean and std, like the MNIST normalisation. Shape (N, 1, 8, 8).
"""
from __future__ import annotations

import numpy as np
import torch

from runner.data.base import DATASETS, DataInfo, Dataset
from runner.errors import DprunError


@DATASETS.register("digits")
def load_digits(cfg, root) -> Dataset:
    try:
        from sklearn.datasets import load_digits as sk_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise DprunError("dataset=digits needs scikit-learn: pip install 'dprun[demo]' (or -e '.[demo]' in a "
                         "checkout)") from e

    bunch = sk_digits()
    x = bunch.images.astype(np.float32) / 16.0  # (1797, 8, 8)
    y = bunch.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, std = xtr.mean(), xtr.std()
    to_t = lambda a: torch.from_numpy((a - mean) / std).unsqueeze(1)  # (N, 1, 8, 8)
    info = DataInfo("digits", (1, 8, 8), 10, train_size=len(ytr), test_size=len(yte))
    return Dataset(info, to_t(xtr), torch.from_numpy(ytr), to_t(xte), torch.from_numpy(yte), source="real")
