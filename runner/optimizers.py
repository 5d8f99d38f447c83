"""SGD and Adam. On a privatized gradient they are DP-SGD and DP-Adam (the noise is already in p.grad).

`optimizer.impl`: foreach (default: one multi-tensor kernel per update term instead of one per parameter, on CPU
and CUDA), fused (one fused kernel; CUDA, and CPU for SGD/Adam in recent torch) or forloop (torch's per-parameter
reference loop). The update is the same to float rounding.
"""
from __future__ import annotations

import torch

from runner.errors import DprunError
from runner.registry import Registry

OPTIMIZERS = Registry("optimizer")  # name = conf/optimizer/<name>.yaml; builder(cfg, params, lr)
IMPLS = ("foreach", "fused", "forloop")  # optimizer.impl: how torch applies the update (foreach: few launches)


def impl_kwargs(cfg) -> dict:
    impl = str(cfg.get("impl", "foreach") or "foreach")
    if impl not in IMPLS:
        raise DprunError(f"unknown optimizer.impl {impl!r}; valid: {', '.join(IMPLS)}")
    return {"foreach": True} if impl == "foreach" else {"fused": True} if impl == "fused" else {"foreach": False}


@OPTIMIZERS.register("sgd")
def sgd(cfg, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=float(cfg.get("momentum", 0.0)),
                           weight_decay=float(cfg.get("weight_decay", 0.0)), **impl_kwargs(cfg))


@OPTIMIZERS.register("adam")
def adam(cfg, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, betas=tuple(cfg.get("betas", (0.9, 0.999))),
                            eps=float(cfg.get("eps", 1e-8)), weight_decay=float(cfg.get("weight_decay", 0.0)),
                            **impl_kwargs(cfg))


def build_optimizer(cfg, params, lr: float) -> torch.optim.Optimizer:
    return OPTIMIZERS.build(str(cfg.name), cfg, params, lr)
