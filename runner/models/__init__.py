"""The model zoo: one file per family, each builder registered in MODELS as `fn(info: DataInfo, **kw) -> nn.Module`."""
from __future__ import annotations

from runner.models import mlp  # noqa: F401  (each family registers in MODELS)
from runner.models.base import MODELS  # noqa: F401


def build(name: str, info, **kwargs):
    return MODELS.build(name, info, **kwargs)
