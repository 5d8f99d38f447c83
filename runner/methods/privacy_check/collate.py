"""make_private's DataLoader path: a collate_fn must build each example's rows from that example alone.

    check_collate(dataset, collate, method)    # DprunError naming the example and the field that differ

The first-step check sees only the collated batch, so a collate_fn that couples the batch (pad each batch to its
longest sequence, normalise by the batch's statistics) passes it: with the usual NLP collator and a model that
averages over positions, pads included, one long record moved every method's release by 6.81 C (stop 55's review).
make_private collates examples spread over the dataset alone and together, and the first batch's examples alone
against that batch (where the loader collates in this process): each example's rows must be equal. It sees the
collator on this data only: one that couples only some records (all of one length but a crafted one) is caught by
the first batch that holds such a record, if that is the first batch.
A collator that pads to the batch's longest is refused (pad to a fixed length instead); one whose padding the model
ignores exactly can be run with make_private(validate=False), and the run's privacy notes then say it is unchecked.
A random augmentation in the Dataset's __getitem__ draws other values alone and in a batch, which is no coupling: the
probe over the dataset fetches every example with torch's, numpy's and Python's RNGs seeded by its index (`seeded`),
alone and for the batch alike; on the loader's first batch, whose draws cannot be replayed, an example that collates
otherwise twice in a row alone is not compared (until review 28 such a Dataset was refused as "not per-example").
"""
from __future__ import annotations

import random
from typing import Any, Callable

import numpy
import torch

from runner.errors import DprunError

PROBE = 8  # examples: a pad-to-longest collator is seen unless all of them have one length


def first_difference(alone: Any, together: Any, row: int, where: str = "batch") -> str | None:
    """Where example `row` of `together` (a collated batch) differs from `alone` (that example collated alone), as
    a path ("batch[0]: shape (1, 5) alone, (1, 400) in the batch"), or None where they agree."""
    if isinstance(alone, torch.Tensor) and isinstance(together, torch.Tensor):
        if alone.dim() == 0 or together.dim() == 0:
            return None if torch.equal(alone, together) else f"{where}: {alone} alone, {together} in the batch"
        if alone.shape[1:] != together.shape[1:]:
            return (f"{where}: shape {tuple(alone.shape)} alone, {tuple(together[row:row + 1].shape)} in the batch "
                    f"(padded to the batch's longest?)")
        same = torch.equal(alone[0], together[row]) or (alone.is_floating_point() and bool(
            torch.isnan(alone[0]).eq(torch.isnan(together[row])).all()) and torch.equal(
            alone[0].nan_to_num(0.0), together[row].nan_to_num(0.0)))
        return None if same else f"{where}: the values of the example's row differ alone and in the batch"
    if isinstance(alone, (list, tuple)) and isinstance(together, (list, tuple)) and len(alone) == len(together):
        for i, (a, t) in enumerate(zip(alone, together)):
            found = first_difference(a, t, row, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(alone, dict) and isinstance(together, dict) and alone.keys() == together.keys():
        for k in alone:
            found = first_difference(alone[k], together[k], row, f"{where}[{k!r}]")
            if found:
                return found
        return None
    return None if type(alone) is type(together) else f"{where}: a {type(alone).__name__} alone, a " \
                                                       f"{type(together).__name__} in the batch"


def seeded(index: int, fetch: Callable[[], Any]) -> Any:
    """fetch() with torch's CPU, numpy's and Python's global RNGs seeded by `index`, their states restored after: a
    random augmentation draws alike for the same record wherever it is fetched (and on every rank). The CPU generator
    alone: torch.manual_seed seeds every CUDA generator too, which fork_rng(devices=[]) does not restore, so after
    make_private's secret reseed (rng=secure) a GPU run's dropout came from the last probed index (review 41)."""
    py_state, np_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(index), random.seed(index), numpy.random.seed(index)
            return fetch()
    finally:
        random.setstate(py_state)
        numpy.random.set_state(np_state)


def check_collate(dataset, collate: Callable, method: str, indices: list[int] | None = None,
                  together: Any = None) -> None:
    """Each of the examples `indices` collated alone must equal its row of `together`, their collated batch (as
    the loader yielded it); without them, the first PROBE examples of the dataset and PROBE more spread over it,
    each fetched seeded by its index (alone and for the batch alike)."""
    own = indices is None
    if own:
        n = len(dataset)
        indices = sorted(set(range(min(PROBE, n))) | {i * n // PROBE for i in range(PROBE)})
        together = collate([seeded(i, lambda i=i: dataset[i]) for i in indices]) if len(indices) >= 2 else None
    if together is None or len(indices) < 2:
        return
    for row, i in enumerate(indices):
        alone = collate([seeded(i, lambda i=i: dataset[i]) if own else dataset[i]])
        if not own and first_difference(alone, collate([dataset[i]]), 0) is not None:
            continue  # random alone (an augmentation): the loader's draw for this row cannot be replayed
        found = first_difference(alone, together, row)
        if found:
            raise DprunError(f"collate_fn is not per-example: example {i} of the dataset collated alone and in a "
                             f"batch of {len(indices)} differs ({found}), so an example's input depends on the "
                             f"others in its batch, which method={method}'s per-example clipping cannot bound; pad "
                             f"to a fixed length, or (if the model ignores the padding exactly) pass validate=False")
