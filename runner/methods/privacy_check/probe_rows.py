"""Which examples the first-step check runs on: ones that differ in what a forward could sort or group the batch by.

    order, k = spread_first(x, y)         # row indices: the k rows with extreme keys first, then the rest in order
    records = dataset_probe(data)         # at assemble: a few training records with extreme keys, or None
    features = feature_extremes(data)     # at assemble: each feature's largest and smallest record (row_order.py)

A forward that reorders the batch by its data and restores the order afterwards (sorting by length before packing
a sequence) is the identity on rows whose keys tie. The check compares each probed row with its example on the rows
as drawn and reversed, so on tied rows it sees nothing wrong; the later batches whose keys differ then clipped each
row of a per-layer method by another example's factor: up to 1.53 C (reweight bk) and 1.98 C (twopass) per example,
accepted whenever the first batch's first four rows had the same length (review 6). So the probe takes the rows with
the smallest and largest value of each key below (the count of zeros: a padded text's length; the label; the sum,
largest and smallest entry; for rows of at most COLUMNS features, each feature), from the first batch and, where the run's training set is in memory, from the whole
training set. A key no statistic here separates, or a reorder triggered by a value no probed record has, is still
not seen (docs/privacy.md, the first-step check's "What it cannot see").
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

DATASET_RECORDS = 4  # training records added to the probe for the keys below (its cost: a few passes each, once)
COLUMNS = 16  # rows at most this wide (tabular features) are also probed at each column's extremes (review 7: a
# stable sort by a float flag, 0.3 in 99% of the records and 0.4 in 1%, passed 5 of 6 seeds; twopass then released
# 2.3-3.7 C per example)
CHUNK = 8192  # rows per pass over a training set (a (CHUNK, d) comparison at a time, not (N, d))


def keys(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Per-row keys, each (n,) float64: count of zeros, label, sum, max, min (the label's only where y has a row per
    x's), then each feature of rows at most COLUMNS wide. Rows that are not finite get nan."""
    flat = x.reshape(len(x), -1)
    finite = torch.isfinite(flat).all(1) if flat.is_floating_point() else torch.ones(len(x), dtype=torch.bool,
                                                                                      device=x.device)
    if flat.shape[1] == 0:
        return []
    label = (y.reshape(len(y), -1).double().sum(1) if isinstance(y, torch.Tensor) and len(y) == len(x)
             else torch.zeros(len(x), dtype=torch.float64, device=x.device))
    out = [(flat == 0).sum(1).double(), label, flat.sum(1).double(), flat.amax(1).double(), flat.amin(1).double()]
    if flat.shape[1] <= COLUMNS:
        out += [flat[:, j].double() for j in range(flat.shape[1])]
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    return [torch.where(finite & torch.isfinite(k), k, nan) for k in out]


def extremes(columns: list[torch.Tensor]) -> list[int]:
    """For each key: the first row with its largest value, then the first with its smallest (nan rows never)."""
    chosen: list[int] = []
    for k in columns:
        ok = ~torch.isnan(k)
        if not bool(ok.any()):
            continue
        for v in (k[ok].max(), k[ok].min()):
            row = int((ok & (k == v)).nonzero()[0, 0])
            if row not in chosen:
                chosen.append(row)
    return chosen


def spread_first(x: torch.Tensor, y: torch.Tensor) -> tuple[list[int], int]:
    """All row indices of the batch, those with extreme keys first (extremes), then the others in batch order; and
    how many came first."""
    first = extremes(keys(x, y))
    return first + [i for i in range(len(x)) if i not in set(first)], len(first)


def training_tensors(data: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x (N, ...), y (N,)) of a run's in-memory training set (runner/data/base.py Dataset: train_x, train_y; a torch
    TensorDataset of (x, y)); None without one (another Dataset: its records are not read here)."""
    x, y = getattr(data, "train_x", None), getattr(data, "train_y", None)
    tensors = getattr(data, "tensors", None)  # a torch TensorDataset (make_private's Dataset or DataLoader source)
    if x is None and isinstance(tensors, tuple) and len(tensors) == 2:
        x, y = tensors
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or len(x) < 2 or len(y) != len(x):
        return None
    return x, y


def attach_probes(method, data: Any) -> None:
    """Where a run's training set is in memory, leave on the method what the first step's check reads of it: a few
    records with extreme keys (dataset_probe) and each feature's extremes (feature_extremes, row_order.py)."""
    method.probe_records = dataset_probe(data)
    method.probe_features = feature_extremes(data)


def dataset_probe(data: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
    """Up to DATASET_RECORDS training records with extreme keys (x (k, ...), y (k,), their names for messages), from
    the training set when it is in memory (training_tensors), else None. One pass over the set in chunks of CHUNK
    rows."""
    both = training_tensors(data)
    if both is None:
        return None
    x, y = both
    parts = [keys(x[s:s + CHUNK], y[s:s + CHUNK]) for s in range(0, len(x), CHUNK)]
    columns = [torch.cat(c) for c in zip(*parts)] if parts and parts[0] else []
    general = extremes(columns[:5])[:DATASET_RECORDS]  # keys() puts the five general keys first
    rows = general + [r for r in extremes(columns[5:]) if r not in general]  # each column's, for narrow rows
    if len(rows) < 2:
        return None
    index = torch.tensor(rows, device=x.device)
    return x[index].clone(), y[index].clone(), [f"training record {r}" for r in rows]


@dataclasses.dataclass
class FeatureExtremes:
    """Each feature's largest and smallest value over the training set's finite records, and the first record
    holding it (row_order.py adds the records of the features the first batch's rows tie on)."""
    x: torch.Tensor  # (N, ...) the training inputs (a reference, not a copy)
    y: torch.Tensor  # (N,)
    largest: torch.Tensor  # (d,) each flattened feature's largest value
    smallest: torch.Tensor  # (d,)
    at_largest: torch.Tensor  # (d,) long: a record holding it
    at_smallest: torch.Tensor  # (d,) long


def feature_extremes(data: Any) -> FeatureExtremes | None:
    """FeatureExtremes of the in-memory training set (training_tensors), else None. One pass in chunks of CHUNK rows
    (amax / amin, then the first row equal to each: torch's max(0) with indices is ~20x slower on the CPU)."""
    both = training_tensors(data)
    if both is None:
        return None
    x, y = both
    best = None  # (largest, smallest, at_largest, at_smallest)
    for s in range(0, len(x), CHUNK):
        flat = x[s:s + CHUNK].reshape(min(CHUNK, len(x) - s), -1)  # (c, d)
        if flat.shape[1] == 0:
            return None
        if flat.is_floating_point():  # a record that is not finite is never probed (it adds nothing to a release)
            finite = torch.isfinite(flat.sum(1, keepdim=True))  # (c, 1); an overflowing sum: also left out
            high = flat if bool(finite.all()) else torch.where(finite, flat, float("-inf"))
            low = flat if bool(finite.all()) else torch.where(finite, flat, float("inf"))
        else:
            high = low = flat
        hi, lo = high.amax(0), low.amin(0)  # (d,)
        at_hi = (high == hi).to(torch.uint8).argmax(0) + s  # (d,) the first row holding it
        at_lo = (low == lo).to(torch.uint8).argmax(0) + s
        if best is not None:
            up, down = hi > best[0], lo < best[1]
            hi, at_hi = torch.where(up, hi, best[0]), torch.where(up, at_hi, best[2])
            lo, at_lo = torch.where(down, lo, best[1]), torch.where(down, at_lo, best[3])
        best = (hi, lo, at_hi, at_lo)
    return FeatureExtremes(x, y, *best)
