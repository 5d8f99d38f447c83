"""The model zoo: one file per family, each builder registered in MODELS as `fn(info: DataInfo, **kw) -> nn.Module`.

    from runner import models
    model = models.build("cnn", info, hidden=128)      # kwargs = conf/model/cnn.yaml minus `name`

Registry names = conf/model/<name>.yaml names = CLI names (`dprun model=cnn`); docs/models.md lists them.
"""
from __future__ import annotations

import inspect

from runner.errors import DprunError
from runner.models import bu_cnn, cnn, mlp, papernot_cnn, resnet, rnn, transformer, vgg  # noqa: F401  (register)
from runner.models.base import MODELS


def build(name: str, info, **kwargs):
    """Build a registered model; an unknown knob is a one-line DprunError naming the knobs the model accepts."""
    params = inspect.signature(MODELS.get(name)).parameters
    knobs = [p for p in params if p not in ("info", "name")]
    unknown = [k for k in kwargs if k not in knobs]
    if unknown:
        raise DprunError(f"unknown option model.{unknown[0]} for model={name}; valid: {', '.join(knobs)}")
    return MODELS.build(name, info, **kwargs)
