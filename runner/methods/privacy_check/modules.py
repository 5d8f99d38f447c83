"""Module configurations that write the training data into the released state, refused before any step.

    check_modules(model, "reweight")     # DprunError naming the module, e.g. emb (Embedding, max_norm=1.0)

These are found by type and setting because their write depends on the data: Embedding(max_norm=...) renormalises
in place only the rows a batch looks up whose norm exceeds max_norm (one rare token suffices), and an InstanceNorm
with track_running_stats=True keeps running statistics of the raw data in buffers saved with the model. No method
can run them privately (the write is not a gradient, so no clipping or noise covers it). BatchNorm is refused by
Method.validate itself. Any other write shows up in the first step's check (runner/methods/privacy_check/state.py).
"""
from __future__ import annotations

from torch import nn

from runner.errors import DprunError


def check_modules(model: nn.Module, method: str) -> None:
    for path, m in model.named_modules():
        where = f"{path or '<model>'} ({type(m).__name__}"
        if isinstance(m, nn.Embedding) and m.max_norm is not None:
            raise DprunError(f"{where}, max_norm={m.max_norm}) cannot be trained with method={method}: its forward "
                             f"renormalises the looked-up rows of the weight in place, writing the batch's data "
                             f"into the released weights outside any clipping or noise (no method can bound it); "
                             f"use max_norm=None")
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            raise DprunError(f"{where}, track_running_stats=True) cannot be trained with method={method}: its "
                             f"running statistics of the raw training data are buffers released with the model "
                             f"(no method can bound them); use track_running_stats=False, or GroupNorm")
