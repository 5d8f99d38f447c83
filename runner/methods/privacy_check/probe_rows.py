"""Which examples the first-step check runs on: ones that differ in what a forward could sort or group the batch by.

    order, k = spread_first(x, y)         # row indices: the k rows with extreme keys first, then the rest in order
    attach_probes(method, data, collate)  # at assemble / make_private: both below, read as the batches hold them
    records = dataset_probe(data)         # a few training records with extreme keys, or None
    features = feature_extremes(data)     # each feature's largest and smallest record (row_order.py)

A forward that reorders the batch by its data and restores the order afterwards (sorting by length before packing
a sequence) is the identity on rows whose keys tie. The check compares each probed row with its example on the rows
as drawn and reversed, so on tied rows it sees nothing wrong; the later batches whose keys differ then clipped each
row of a per-layer method by another example's factor: up to 1.53 C (reweight bk) and 1.98 C (twopass) per example,
accepted whenever the first batch's first four rows had the same length (review 6). So the probe takes the rows with
the smallest and largest value of each key below (the count of entries that are not finite: a record with an
imputed nan; the count of zeros: a padded text's length; the label; the sum, largest and smallest finite entry; for
rows of at most COLUMNS features, each feature), from the first batch and, where the run's training set is in
memory, from the whole training set, read as the batches hold it (a DataLoader's collate_fn applied). A key no statistic here separates, or a reorder triggered by a value no probed record has, is still
not seen (docs/privacy.md, the first-step check's "What it cannot see").
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.utils.data import TensorDataset, default_collate

log = logging.getLogger("dprun")

DATASET_RECORDS = 4  # training records added to the probe for the keys below (its cost: a few passes each, once)
COLUMNS = 16  # rows at most this wide (tabular features) are also probed at each column's extremes (review 7: a
# stable sort by a float flag, 0.3 in 99% of the records and 0.4 in 1%, passed 5 of 6 seeds; twopass then released
# 2.3-3.7 C per example)
CHUNK = 8192  # rows per pass over a training set (a (CHUNK, d) comparison at a time, not (N, d))
GENERAL = 6  # keys() puts its general keys first, then one per feature of narrow rows
Records = Callable[[Any], "tuple[torch.Tensor, torch.Tensor] | None"]  # records(index) -> (x (k, ...), y (k,))


def keys(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Per-row keys, each (n,) float64: count of entries that are not finite (nan on rows with none), count of
    zeros, label, sum, max, min (over the row's finite entries; the label's only where y has a row per x's), then
    each feature of rows at most COLUMNS wide (nan where that entry is not finite). A record with a nan input that
    the model imputes trains like any other (review 14: a model mixing the batch among such records only, or sorting
    by a flag only they carry, was never probed: bk 7 C, twopass 51-568 C), so its finite entries count, and the
    first key puts such records among the extremes."""
    flat = x.reshape(len(x), -1)  # (n, d)
    if flat.shape[1] == 0:
        return []
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    label = (y.reshape(len(y), -1).double().sum(1) if isinstance(y, torch.Tensor) and len(y) == len(x)
             else torch.zeros(len(x), dtype=torch.float64, device=x.device))
    total = flat.sum(1)  # (n,)
    bad = non_finite(flat, total)  # (n, d) or None where every entry is finite
    count = bad.sum(1).double() if bad is not None else torch.zeros(len(x), dtype=torch.float64, device=x.device)
    high = low = flat
    if bad is not None:  # the entries that are not finite: never a max or a min, 0 in the sum (the first key's)
        high, low, flat = flat.masked_fill(bad, float("-inf")), flat.masked_fill(bad, float("inf")), flat.masked_fill(
            bad, 0)
        total = flat.sum(1)
    out = [torch.where(count > 0, count, nan), (flat == 0).sum(1).double() - count, label, total.double(),
           high.amax(1).double(), low.amin(1).double()]
    if flat.shape[1] <= COLUMNS:
        out += [flat[:, j].double() if bad is None else torch.where(bad[:, j], nan, flat[:, j].double())
                for j in range(flat.shape[1])]
    return [torch.where(torch.isfinite(k), k, nan) for k in out]


def non_finite(flat: torch.Tensor, total: torch.Tensor) -> torch.Tensor | None:
    """(n, d) bool: flat's entries that are not finite; None where there are none (total, flat's row sums (n,), all
    finite: one cheap look, the elementwise one only otherwise)."""
    if not flat.is_floating_point() or bool(torch.isfinite(total).all()):
        return None
    bad = ~torch.isfinite(flat)
    return bad if bool(bad.any()) else None


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


def batch_xy(batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x, y) of a collated batch as make_private's step takes it (`for x, y in private.batches()`: a pair of tensors
    of the same examples), else None."""
    if (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) and t.dim() > 0 for t in batch)
            and len(batch[0]) == len(batch[1])):
        return batch[0], batch[1]
    return None


def batched(data: Any, collate: Callable | None = None) -> Records | None:
    """records(index) -> (x (k, ...), y (k,)): the training records `index` (a slice or a (k,) long tensor) as a batch
    holds them: collate([data[i] for i in index]) where make_private's DataLoader collates (review 14: uint8 records
    that its collate_fn cast to float were never probed, the dtypes differing: 2.56 C bk, 319 C twopass), the
    stored tensors where nothing converts them (the CLI's batches are train_x[idx] gathers; make_private's tensors;
    a TensorDataset under the default collate). None without an in-memory training set (training_tensors)."""
    both = training_tensors(data)
    if both is None:
        return None
    x, y = both
    if collate is None or (collate is default_collate and type(data).__getitem__ is TensorDataset.__getitem__):
        return lambda index: (x[index], y[index])

    def records(index):
        if type(data).__getitem__ is TensorDataset.__getitem__:  # its records, without a Python call each (~7x)
            return batch_xy(collate(list(zip(*(t[index] for t in data.tensors)))))
        rows = range(len(x))[index] if isinstance(index, slice) else index.tolist()
        return batch_xy(collate([data[i] for i in rows]))
    return records


def attach_probes(method, data: Any, collate: Callable | None = None) -> None:
    """Where a run's training set is in memory, leave on the method what the first step's check reads of it, as the
    batches hold it (`collate`: make_private's DataLoader's collate_fn): a few records with extreme keys
    (dataset_probe) and each feature's extremes (feature_extremes, row_order.py)."""
    records = batched(data, collate)
    if records is not None and records(slice(0, 2)) is None:
        log.warning("the first step's check reads no training records: the DataLoader's collate_fn gives no (x, y) "
                    "pair of tensors; only the first batch is probed")
        records = None
    method.probe_records = dataset_probe(data, records)
    method.probe_features = feature_extremes(data, records)


def like_batch(found: torch.Tensor, x: torch.Tensor, what: str) -> torch.Tensor | None:
    """found (k, ...), training records read as the batches hold them, on x's device and in its dtype where their
    rows are like x's (shape; floating or not), else None with a warning naming what the first step's check leaves
    out (a collate_fn that makes the batch's rows otherwise than from each record alone: never silent)."""
    if found.shape[1:] == x.shape[1:] and found.is_floating_point() == x.is_floating_point():
        return found.to(x.device, x.dtype)
    log.warning(f"the first step's check leaves out {what} ({len(found)}): read as the batches hold them they are "
                f"{found.dtype} {tuple(found.shape[1:])}, the batch's rows {x.dtype} {tuple(x.shape[1:])}")
    return None


def in_chunks(records: Records, n: int):
    """(start, x, y) of each CHUNK of the n records, as the batch holds them."""
    for s in range(0, n, CHUNK):
        yield (s, *records(slice(s, min(s + CHUNK, n))))


def dataset_probe(data: Any, records: Records | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
    """Up to DATASET_RECORDS training records with extreme keys (x (k, ...), y (k,), their names for messages), as
    the batch holds them (`records`, default the stored tensors: batched), from the training set when it is in
    memory (training_tensors), else None. One pass over the set in chunks of CHUNK rows."""
    both = training_tensors(data)
    records = records or batched(data)
    if both is None or records is None:
        return None
    parts = [keys(x, y) for _, x, y in in_chunks(records, len(both[0]))]
    columns = [torch.cat(c) for c in zip(*parts)] if parts and parts[0] else []
    general = extremes(columns[:GENERAL])[:DATASET_RECORDS]
    rows = general + [r for r in extremes(columns[GENERAL:]) if r not in general]  # each column's, for narrow rows
    if len(rows) < 2:
        return None
    x, y = records(torch.tensor(rows))
    return x.clone(), y.clone(), [f"training record {r}" for r in rows]


@dataclasses.dataclass
class FeatureExtremes:
    """Each feature's largest and smallest finite value over the training set's records as the batch holds them, and
    the first record holding it (row_order.py adds the records of the features the first batch's rows tie on)."""
    records: Records  # records(index) -> (x (k, ...), y (k,)) as the batch holds them (batched)
    largest: torch.Tensor  # (d,) each flattened feature's largest value
    smallest: torch.Tensor  # (d,)
    at_largest: torch.Tensor  # (d,) long: a record holding it
    at_smallest: torch.Tensor  # (d,) long


def feature_extremes(data: Any, records: Records | None = None) -> FeatureExtremes | None:
    """FeatureExtremes of the in-memory training set (training_tensors) as the batch holds it (`records`, default the
    stored tensors), else None. One pass in chunks of CHUNK rows (amax / amin, then the first row equal to each:
    torch's max(0) with indices is ~20x slower on the CPU). An entry that is not finite is never an extreme; its
    record can still be another feature's (review 14: a record with an imputed nan trains like any other)."""
    both = training_tensors(data)
    records = records or batched(data)
    if both is None or records is None:
        return None
    best = None  # (largest, smallest, at_largest, at_smallest)
    for s, x, _ in in_chunks(records, len(both[0])):
        flat = x.reshape(len(x), -1)  # (c, d)
        if flat.shape[1] == 0:
            return None
        bad = non_finite(flat, flat.sum(1))  # (c, d) or None
        high = low = flat
        if bad is not None:
            high, low = flat.masked_fill(bad, float("-inf")), flat.masked_fill(bad, float("inf"))
        hi, lo = high.amax(0), low.amin(0)  # (d,); a feature with no finite entry: -inf / inf, never an extreme
        at_hi = (high == hi).to(torch.uint8).argmax(0) + s  # (d,) the first row holding it
        at_lo = (low == lo).to(torch.uint8).argmax(0) + s
        if best is not None:
            up, down = hi > best[0], lo < best[1]
            hi, at_hi = torch.where(up, hi, best[0]), torch.where(up, at_hi, best[2])
            lo, at_lo = torch.where(down, lo, best[1]), torch.where(down, at_lo, best[3])
        best = (hi, lo, at_hi, at_lo)
    return FeatureExtremes(records, *best)
