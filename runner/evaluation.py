"""Test-set evaluation: mean loss and accuracy, on the whole test split or on a fixed stratified subset of it.

    idx = eval_subset(test_y, 2048)                  # max_eval_batches * eval_batch_size examples, every class in
                                                     # proportion, the same examples for every run (seed 0)
    loss, acc = evaluate(model, test_x, test_y, 1024, idx)       # idx None: the whole split

A capped evaluation must not be the FIRST examples: IMDB's test split is stored sorted by label, so its first
2,048 reviews are all negative and two capped runs scored 0.35 and 0.75 on one class. On several ranks each
evaluates its contiguous share and the sums are added (runner/distributed.py): the same numbers as one process.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.precision import to_float32

SUBSET_SEED = 0  # fixed: every run (and every resume) evaluates the same examples


def eval_subset(y: torch.Tensor, n: int) -> torch.Tensor | None:
    """Indices (n,) of a stratified random subset of the labels y (N,): each class gets its share of n (largest
    remainders), drawn at random within the class by a fixed generator; sorted. None when n >= N (all of it)."""
    N = len(y)
    if n >= N:
        return None
    g = torch.Generator().manual_seed(SUBSET_SEED)
    labels = y.cpu()
    classes, counts = labels.unique(return_counts=True)
    exact = counts.double() * n / N
    take = exact.floor().long()
    extra = n - int(take.sum())
    take[torch.argsort(exact - take.double(), descending=True, stable=True)[:extra]] += 1
    chosen = []
    for c, k in zip(classes.tolist(), take.tolist()):
        members = (labels == c).nonzero().squeeze(1)
        chosen.append(members[torch.randperm(len(members), generator=g)[:k]])
    return torch.cat(chosen).sort().values.to(y.device)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
             indices: torch.Tensor | None = None, world=None, device: torch.device | None = None) -> tuple[float, float]:
    """Mean loss and accuracy over (x, y)[indices] (all rows when None), in eval mode; on a World of several
    ranks, each evaluates its share and the sums are added."""
    if indices is None:
        indices = torch.arange(len(y), device=y.device)
    total = len(indices)
    if world is not None:
        indices = world.share(indices)
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(indices), batch_size):
        idx = indices[i:i + batch_size]
        out = model(x[idx])
        loss += F.cross_entropy(to_float32(out), y[idx], reduction="sum").item()
        correct += (out.argmax(1) == y[idx]).sum().item()
    model.train()
    if world is not None:
        loss, correct = world.sum([loss, correct], device or y.device)
    return loss / max(1, total), correct / max(1, total)
