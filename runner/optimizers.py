"""SGD and Adam. On a privatized gradient they are DP-SGD and DP-Adam (the noise is already in p.grad)."""
from __future__ import annotations

import torch

from runner.registry import Registry

OPTIMIZERS = Registry("optimizer")  # name = conf/optimizer/<name>.yaml; builder(cfg, params, lr)


@OPTIMIZERS.register("sgd")
def sgd(cfg, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=float(cfg.get("momentum", 0.0)),
                           weight_decay=float(cfg.get("weight_decay", 0.0)))


@OPTIMIZERS.register("adam")
def adam(cfg, params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, betas=tuple(cfg.get("betas", (0.9, 0.999))),
                            eps=float(cfg.get("eps", 1e-8)), weight_decay=float(cfg.get("weight_decay", 0.0)))


def build_optimizer(cfg, params, lr: float) -> torch.optim.Optimizer:
    return OPTIMIZERS.build(str(cfg.name), cfg, params, lr)
