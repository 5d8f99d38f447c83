"""Shape contracts: the loss is exactly (B,), every rule's norms exactly (B,), every hooked call batch-first.

    check_losses(losses, B)                      # loss_fn returned one loss per example, shape (B,): never broadcast
    check_norms(norms, B, "reweight")            # the method's per-example norms, shape (B,)
    check_batch_first(model, x, "reweight")      # every call of a module with trainable parameters: input (B, ...)

A mean (scalar) loss gives every example the batch's gradient, so clipping per example bounds nothing (reweight
gave a wrong clipped sum, jl an IndexError). A module called on an input whose first dimension is not the batch
(an nn.Embedding of torch.arange(T): a learned positional table) breaks the per-layer rules, which take row i of
every recorded call to be example i (T x C released at T = 5 in a chunk of one); the black-box methods run it.
"""
from __future__ import annotations

import torch
from torch import nn

from runner.errors import DprunError

BLACK_BOX = "method=jl, multiloss or nxbp (they never split the gradient by layer)"


def check_losses(losses, batch: int) -> None:
    shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
    if shape != (batch,):
        raise DprunError(f"loss_fn returned {'shape ' + str(shape) if torch.is_tensor(losses) else shape} for a "
                         f"batch of {batch} examples; it must return one loss per example, shape (B,) = ({batch},), "
                         f"e.g. F.cross_entropy(outputs, y, reduction='none') (never their mean, never broadcast)")


def check_norms(norms, batch: int, method: str) -> None:
    if norms is not None and tuple(norms.shape) != (batch,):
        raise DprunError(f"method={method} gave per-example norms of shape {tuple(norms.shape)} for a batch of "
                         f"{batch} examples, not (B,) = ({batch},): its clip factors would be broadcast; a module "
                         f"of the model is probably called on an input that is not batch-first; use {BLACK_BOX}")


def covered(model: nn.Module):
    """(path, module) for every module with its own trainable parameters: the modules per-layer rules hook."""
    for path, m in model.named_modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            yield path or "<model>", m


def first_input(args, kwargs):
    for v in (*args, *kwargs.values()):
        if torch.is_tensor(v):
            return v
    return None


def each_call_input(model: nn.Module, x, visit) -> None:
    """One forward of x with visit(path, module, input) at every call of a covered module that takes a tensor (its
    first), in call order."""

    def hook(path):
        def record(module, args, kwargs):
            inp = first_input(args, kwargs)
            if inp is not None:
                visit(path, module, inp)
        return record

    handles = [m.register_forward_pre_hook(hook(path), with_kwargs=True) for path, m in covered(model)]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def check_batch_first(model: nn.Module, x: torch.Tensor, method: str) -> None:
    """One forward of x (B rows): every call of a covered module must take an input whose first dimension is B."""
    batch, seen = len(x), []

    def visit(path, module, inp):
        if (inp.dim() == 0 or inp.shape[0] != batch) and not seen:
            seen.append((path, module, tuple(inp.shape)))

    each_call_input(model, x, visit)
    if seen:
        path, module, shape = seen[0]
        raise DprunError(f"{path} ({type(module).__name__}) is called on an input of shape {shape} whose first "
                         f"dimension is not the batch's {batch} (e.g. an Embedding of torch.arange(T), a positional "
                         f"table): method={method} takes row i of each call of a layer to be example i, so its norms "
                         f"would not bound the released sum; use {BLACK_BOX}")
