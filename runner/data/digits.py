"""scikit-learn's bundled 8x8 digits (1,797 images): real data that works offline. Used by the demo and tests.

Split: a fixed stratified 80/20 train/test split (seed 0). Pixels (0..16) are scaled to [0, 1], then mapped to
[-1, 1] with the fixed constants MEAN = STD = 0.5. Shape (N, 1, 8, 8).

Why fixed constants: standardising with the training split's own mean/std makes the input transform a function of
the private data that no accountant covers. 0.5/0.5 follow from the pixel range alone (no data is read to pick
them); they are close to the data's actual mean 0.31 / std 0.38 in scale, so training behaves the same.
"""
from __future__ import annotations

import numpy as np
import torch

from runner.data.base import DATASETS, DataInfo, Dataset, normalised_range

PIXEL_MAX = 16.0  # the digits' pixels are counts 0..16 (4x4 blocks of a 32x32 bitmap)
MEAN, STD = 0.5, 0.5  # data-independent: [0, 1] -> [-1, 1]


def normalise(images: np.ndarray) -> torch.Tensor:
    """(N, 8, 8) pixel counts 0..16 -> (N, 1, 8, 8) float32 in [-1, 1]; the same map for every split."""
    return torch.from_numpy(((images / PIXEL_MAX - MEAN) / STD).astype(np.float32)).unsqueeze(1)


@DATASETS.register("digits")
def load_digits(cfg, root) -> Dataset:
    from sklearn.datasets import load_digits as sk_digits  # a core dependency; imported here, where it is used,
    from sklearn.model_selection import train_test_split    # since importing scikit-learn takes a second

    bunch = sk_digits()
    x = bunch.images  # (1797, 8, 8) float64 counts 0..16
    y = bunch.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    info = DataInfo("digits", (1, 8, 8), 10, train_size=len(ytr), test_size=len(yte),
                    input_range=normalised_range(MEAN, STD))
    return Dataset(info, normalise(xtr), torch.from_numpy(ytr), normalise(xte), torch.from_numpy(yte), source="real")
