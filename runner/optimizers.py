"""SGD and Adam. On a privatized gradient they are DP-SGD and DP-Adam (the noise is already in p.grad)."""
from __future__ import annotations

import torch

from runner.errors import DprunError
from runner.registry import unknown_name_message

OPTIMIZERS = ("sgd", "adam")


def build_optimizer(cfg, params, lr: float) -> torch.optim.Optimizer:
    name = str(cfg.name)
    wd = float(cfg.get("weight_decay", 0.0))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(cfg.get("momentum", 0.0)), weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=tuple(cfg.get("betas", (0.9, 0.999))),
                                eps=float(cfg.get("eps", 1e-8)), weight_decay=wd)
    raise DprunError(unknown_name_message("optimizer", name, list(OPTIMIZERS)))
