"""The shape of a collated batch: its tensors, and the number of examples they share.

    batch_size_of({"x": x, "y": y})    # len(y), or -1 where the tensors share no first dimension
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


def tensor_leaves(batch, depth: int = 4) -> list[torch.Tensor]:
    """The tensors in a batch: itself, or inside tuples, lists, namedtuples and dicts (a Hugging Face style record)."""
    if torch.is_tensor(batch):
        return [batch]
    if depth == 0:
        return []
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for item in items for t in tensor_leaves(item, depth - 1)]


def batch_size_of(batch) -> int:
    """The number of examples in a DataLoader's batch: the first dimension its tensors share ((x, y): len(y); a dict's
    or a namedtuple's values alike); -1 where they share none (a structure step() cannot take either). Before review
    9 only a tuple's or list's last item was read: a dict batch skipped the size check, and hand-made accumulation of
    two yielded batches in one step (released at rate ~2q, accounted at q) passed."""
    sizes = {len(t) for t in tensor_leaves(batch) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else -1
