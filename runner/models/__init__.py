"""The model zoo: one file per family, each builder registered in MODELS as `fn(info: DataInfo, **kw) -> nn.Module`.

    from runner import models
    model = models.build("cnn", info, hidden=128)      # kwargs = conf/model/cnn.yaml minus `name`; None = default
    models.knobs("cnn", hidden=128)                    # every knob's value for that build: {"widths": ..., ...}

Registry names = conf/model/<name>.yaml names = CLI names (`dprun model=cnn`); docs/models.md lists them.
A model's defaults live in ONE place, its builder's signature; conf/model/<name>.yaml lists the knobs as null.
"""
from __future__ import annotations

import inspect

from runner.errors import DprunError
from runner.models import bu_cnn, cnn, mlp, papernot_cnn, resnet, rnn, transformer, vgg  # noqa: F401  (register)
from runner.models.base import MODELS


def knobs(name: str, **kwargs) -> dict:
    """The builder's knobs with the values a build with kwargs uses (None = the builder's default); an unknown knob
    is a one-line DprunError naming the knobs the model accepts."""
    params = {k: p for k, p in inspect.signature(MODELS.get(name)).parameters.items() if k not in ("info", "name")}
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise DprunError(f"unknown option model.{unknown[0]} for model={name}; valid: {', '.join(params)}")
    defaults = {k: p.default for k, p in params.items() if p.default is not p.empty}
    return {**defaults, **{k: v for k, v in kwargs.items() if v is not None}}


def build(name: str, info, **kwargs):
    """Build a registered model with knobs(name, **kwargs)."""
    return MODELS.build(name, info, **knobs(name, **kwargs))
