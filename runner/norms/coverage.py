"""Which modules carry which parameters: every trainable parameter must be covered by exactly one norm rule.

    plan = plan_model(model)     # raises DprunError naming the first uncovered module (path and type)
    plan.layers                  # [(path, module, rule)] for modules with their own trainable parameters
    plan.matches(model)          # False once the trainable set changed (a parameter unfrozen, a module added)

A module with its own trainable parameters (recurse=False) and no rule is an error that suggests a black-box
method; BatchNorm is always rejected (it mixes the examples of a batch); a parameter shared by two modules
(weight tying) is rejected because its per-example gradient would span two rules.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from runner.errors import DprunError
from runner.norms.base import NormRule, rule_for
from runner.trainable import trainable_ids

BLACK_BOX = "use a black-box method (method=jl or method=multiloss)"

# Module families rejected with a reason (looked up along the MRO: these are families, not layer rules).
REASONS: dict[type, str] = {
    nn.modules.batchnorm._BatchNorm: ("BatchNorm normalises with batch statistics, so an example's gradient depends "
                                      "on the other examples and per-example clipping bounds nothing; use GroupNorm "
                                      "or LayerNorm instead"),
    nn.RNNBase: ("torch's fused RNN/LSTM/GRU keep their per-step inputs internal; use the project's unfused "
                 "model=rnn/lstm/gru/bilstm (runner/models/recurrent.py) or " + BLACK_BOX),
    nn.MultiheadAttention: ("nn.MultiheadAttention bypasses its submodules' forward (fused in_proj_weight); use "
                            "runner.models.attention.SelfAttention or " + BLACK_BOX),
}


def rejection(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls in REASONS:
            return REASONS[cls]
    return None


@dataclass
class Plan:
    layers: list[tuple[str, nn.Module, NormRule]]
    covered: frozenset[int]  # ids of the trainable parameters the rules cover

    def matches(self, model: nn.Module, params: list | None = None) -> bool:
        """The model's trainable parameters are the covered ones (params: trainable(model), when the caller has it)."""
        ids = trainable_ids(model) if params is None else frozenset(id(p) for p in params)
        return ids == self.covered


def plan_model(model: nn.Module) -> Plan:
    layers, owner = [], {}
    for path, module in model.named_modules():
        path = path or "<model>"
        reason = rejection(module)
        if reason is not None:
            raise DprunError(f"{path} ({type(module).__name__}) cannot be clipped per example: {reason}")
        own = {name: p for name, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not own:
            continue
        rule = rule_for(module)
        if rule is None:
            instead = ("use method=multiloss or method=nxbp (each example alone; jl refuses it: torch has no "
                       "forward-mode derivative for it)" if isinstance(module, nn.EmbeddingBag) else BLACK_BOX)
            raise DprunError(f"{path} ({type(module).__name__}) has trainable parameters "
                             f"({', '.join(own)}) but no per-layer norm rule; {instead}, or freeze them")
        uncovered = sorted(set(own) - set(rule.params))
        if uncovered:
            raise DprunError(f"{path} ({type(module).__name__}): the norm rule does not cover parameter(s) "
                             f"{', '.join(uncovered)}; {BLACK_BOX}")
        rule.check(module, path)
        for name, p in own.items():
            if id(p) in owner:
                raise DprunError(f"parameter {path}.{name} is shared with {owner[id(p)]} (weight tying): its "
                                 f"per-example gradient spans two layers; {BLACK_BOX}")
            owner[id(p)] = f"{path}.{name}"
        layers.append((path, module, rule))
    plan = Plan(layers, frozenset(owner))
    if not plan.matches(model):  # a trainable parameter registered outside named_modules (never expected)
        raise DprunError("some trainable parameters are not reachable through the model's modules; "
                         f"{BLACK_BOX}")
    return plan

