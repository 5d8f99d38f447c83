"""Module configurations that write the training data into the released state, refused before any step.

    check_modules(model, "reweight")     # DprunError naming the module, e.g. emb (Embedding, max_norm=1.0)

These are found by type and setting because their write depends on the data: Embedding(max_norm=...) renormalises
in place only the rows a batch looks up whose norm exceeds max_norm (one rare token suffices), and an InstanceNorm
with track_running_stats=True keeps running statistics of the raw data in buffers saved with the model. No method
can run them privately (the write is not a gradient, so no clipping or noise covers it). BatchNorm is refused by
Method.validate itself. Any other write shows up in the first step's check (runner/methods/privacy_check/state.py).

Two more Embedding settings act in the backward only, where the first step's forward probes cannot see them:
sparse=True (a sparse gradient: the noise must cover every row, and several methods cannot form it) for every
private method, and scale_grad_by_freq=True for method=jl, whose clipped sum is the batch's own backward: each
token's row is divided by its count in the whole batch, so an example's contribution moves with the others' tokens
(one example changed the release of a crafted batch by 1.9 C at exact norms). Each example alone (nxbp,
multiloss, Opacus's per-example gradients) scales by its own counts; reweight refuses it in its norm rule.
"""
from __future__ import annotations

from torch import nn

from runner.errors import DprunError

BATCH_BACKWARD = ("jl",)  # the clipped sum is the model's own backward of the whole batch's weighted losses


def check_modules(model: nn.Module, method: str) -> None:
    for path, m in model.named_modules():
        where = f"{path or '<model>'} ({type(m).__name__}"
        if isinstance(m, nn.Embedding) and m.max_norm is not None:
            raise DprunError(f"{where}, max_norm={m.max_norm}) cannot be trained with method={method}: its forward "
                             f"renormalises the looked-up rows of the weight in place, writing the batch's data "
                             f"into the released weights outside any clipping or noise (no method can bound it); "
                             f"use max_norm=None")
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise DprunError(f"{where}, sparse=True) cannot be trained with method={method}: private methods need "
                             f"dense gradients (the noise goes on every row); set sparse=False")
        if isinstance(m, nn.Embedding) and m.scale_grad_by_freq and method in BATCH_BACKWARD:
            raise DprunError(f"{where}, scale_grad_by_freq=True) cannot be trained with method={method}: its "
                             f"backward divides each token's row by its count in the whole batch, so an example's "
                             f"contribution moves with the other examples' tokens; set it to False, or use "
                             f"method=nxbp or multiloss (each example alone)")
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            raise DprunError(f"{where}, track_running_stats=True) cannot be trained with method={method}: its "
                             f"running statistics of the raw training data are buffers released with the model "
                             f"(no method can bound them); use track_running_stats=False, or GroupNorm")


def dropout_off(model: nn.Module) -> None:
    """The dropout modules in eval mode, every other module as it is (train mode: the forward the step runs). A check
    that compares a batch with each example alone needs the same masks in both, which dropout cannot give; eval mode
    for the whole model would check another forward than the step's (review 20: a parameter reached only in train
    mode escaped jl's check). The caller restores the flags."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()
