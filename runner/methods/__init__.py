"""Clipping methods, one file each, behind runner.methods.base.Method (registered in METHODS by name)."""
from __future__ import annotations

from runner.methods import nxbp  # noqa: F401  (each method file registers in METHODS; one import per file)
from runner.methods import multiloss  # noqa: F401
from runner.methods import jl  # noqa: F401  (method=jl: DP-SGD-JL / DP-Adam-JL)
from runner.methods import opacus_peer  # noqa: F401  (method=opacus; not opacus.py, which would shadow the package)
from runner.methods import reweight  # noqa: F401
from runner.methods import sbcd  # noqa: F401  (method=sbcd)
from runner.methods.base import METHODS, Method, StepOutput, clip_factors  # noqa: F401
from runner.errors import NotImplementedYet

ALL_METHOD_NAMES = ("nonprivate", "nxbp", "multiloss", "reweight", "jl", "sbcd", "opacus")


def _not_yet(name: str):
    class NotYet(Method):
        def prepare(self, model, data=None):
            raise NotImplementedYet(f"method={name} is not implemented yet")

    NotYet.name = name
    return NotYet


for _name in ALL_METHOD_NAMES:
    if _name not in METHODS:
        METHODS.register(_name, _not_yet(_name))


def build(cfg) -> Method:
    """The method named by cfg.method.name, with the run's clip, sigma and r."""
    return METHODS.build(str(cfg.method.name), cfg=cfg.method, clip=float(cfg.clip), sigma=float(cfg.sigma),
                         r=int(cfg.r))
