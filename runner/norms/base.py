"""The norm-rule interface and the registry keyed by module type.

A rule knows, for one layer family, how to turn what the hooks recorded (the layer's inputs and the gradients
of the summed loss w.r.t. its outputs) into (a) per-example squared gradient norms and (b) the clip-weighted
sum of per-example gradients (book-keeping mode):

    @register(nn.Linear)
    class LinearRule(NormRule):
        params = ("weight", "bias")
        def sequence(self, layer, inp, grad_out): ...          # one call -> (a, g), per-position, (B, T, ...)
        def norm_sq(self, layer, a, g, how, stash=None): ...   # -> (B,) certified upper bound of the squared norm
        def clipped_sums(self, layer, a, g, nu, stash=None):  # -> {"weight": sum_i nu_i grad_i W, ...}

    rule_for(module)      # the rule registered for type(module) exactly, or None

Lookup is by EXACT type: a subclass may override forward(), so it never silently inherits a rule (register it
explicitly when its forward is the parent's). A module called several times in one forward pass has its calls
concatenated along dim 1 (the position axis T) of `sequence`'s outputs before `norm_sq`: the per-example
gradient is the sum over calls, then the norm.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import nn


HOW = ("auto", "direct", "ghost")  # method.norm: pick the cheaper, materialise per-example grads, or ghost norm

RULES: Dict[type, "NormRule"] = {}


class NormRule:
    params: tuple[str, ...] = ()  # the module's own parameter names this rule covers
    sequence_is_call = False  # True: sequence's (a, g) is itself a valid recorded (input, output-gradient) call
    tensor_cores = False  # True: bf16 records on a GPU are given to the rule as bf16 (runner/norms/tensor_cores.py)

    def check(self, layer: nn.Module, path: str) -> None:
        """Raise DprunError (naming `path`) for a configuration of the layer the rule cannot handle exactly."""

    def sequence(self, layer: nn.Module, inp: torch.Tensor, grad_out: torch.Tensor):
        """One call's input and output-gradient -> (a, g) indexed (B, T, ...); calls concatenate along dim 1."""
        raise NotImplementedError

    def norm_sq(self, layer: nn.Module, a: torch.Tensor, g: torch.Tensor, how: str,
                stash: dict | None = None) -> torch.Tensor:
        """(B,) per example, a CERTIFIED upper bound of the squared norm of its gradient over the layer's trainable
        parameters, as the clipped sum forms it, for any input (runner/norms/certify.py; a rule is registered only
        with an adversarial construction in runner/bench/adversarial.py). `stash` (book-keeping mode only) may keep
        intermediate results, e.g. materialised per-example gradients, for clipped_sums."""
        raise NotImplementedError

    def clipped_sums(self, layer: nn.Module, a: torch.Tensor, g: torch.Tensor, nu: torch.Tensor,
                     stash: dict | None = None) -> dict[str, torch.Tensor]:
        """{param name: sum_i nu_i * per-example gradient} for the layer's trainable parameters; nu (B,)."""
        raise NotImplementedError

    def records_norm_sq(self, layer: nn.Module, inp: torch.Tensor, grad_out: torch.Tensor, how: str,
                        stash: dict | None = None) -> torch.Tensor | None:
        """norm_sq straight from one call's (input, output-gradient), where the rule has a route that skips
        `sequence`'s (a, g) (a conv's kept per-example gradient without its unfolded input); None: no such route
        here, use sequence and norm_sq."""
        return None


    def stash_only(self, layer: nn.Module, stash: dict) -> bool:
        """True when `stash` (filled by norm_sq) alone gives every trainable parameter's clipped sum: book-keeping's
        lean recorder (lean.py) then frees the layer's inputs and output-gradients during the backward, and
        clipped_sums_calls gets no calls. A rule says so only where its clipped_sums use the stash alone."""
        return False

    def clipped_sums_calls(self, layer: nn.Module, calls: list, nu: torch.Tensor,
                           stash: dict | None = None) -> dict[str, torch.Tensor]:
        """clipped_sums from the recorded [(input, output-gradient)] calls; a rule may override it to avoid
        building `sequence`'s (a, g) again (a conv's unfolded input). No calls: stash_only said the stash suffices."""
        if not calls:
            return self.clipped_sums(layer, None, None, nu, stash)
        parts = [self.sequence(layer, inp, grad) for inp, grad in calls]
        a = torch.cat([p[0] for p in parts], 1) if len(parts) > 1 else parts[0][0]
        g = torch.cat([p[1] for p in parts], 1) if len(parts) > 1 else parts[0][1]
        return self.clipped_sums(layer, a, g, nu, stash)


def register(*types: type) -> Callable[[type], type]:
    """Class decorator: instantiate the rule and register it for each module type (exact type match)."""

    def add(cls: type) -> type:
        for t in types:
            if t in RULES:
                raise ValueError(f"norm rule for {t.__name__} registered twice")
            RULES[t] = cls()
        return cls

    return add


def rule_for(module: nn.Module) -> NormRule | None:
    return RULES.get(type(module))


def trains(p: torch.Tensor | None) -> bool:
    """A parameter the rule must cover (present and trainable)."""
    return p is not None and p.requires_grad


def added(tensors) -> torch.Tensor:
    """The tensors (an iterable, at least one) added in order: Python's sum() would start from 0, one more kernel."""
    it = iter(tensors)
    out = next(it)
    for t in it:
        out = out + t
    return out


def total(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """(B,) the sum of a layer's per-parameter squared norms (weight, bias: each (B,) float32), added without a zeros
    tensor to start from (two kernels fewer per layer: a small model's GPU step is launch-bound); zeros of like's
    batch when no parameter trains."""
    if not parts:
        return like.new_zeros(like.shape[0], dtype=torch.float32 if like.dtype == torch.bfloat16 else like.dtype)
    return added(parts)

