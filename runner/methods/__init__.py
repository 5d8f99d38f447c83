"""Clipping methods, one file (DP-SBCD: one package) each, behind runner.methods.base.Method, registered in METHODS
by name; conf/method/<name>.yaml holds each one's options (tests/test_method_contract.py checks the two agree).

    from runner import methods
    method = methods.build(cfg)                  # the method named by cfg.method.name, with the run's clip and sigma
    model = method.attach(model, data)           # validate + prepare; then method.step(model, ...) per batch
"""
from __future__ import annotations

from runner.methods import jl  # noqa: F401  (each import registers its method in METHODS: one import per method)
from runner.methods import multiloss  # noqa: F401
from runner.methods import nxbp  # noqa: F401
from runner.methods import opacus_peer  # noqa: F401  (method=opacus; not opacus.py, which would shadow the package)
from runner.methods import reweight  # noqa: F401
from runner.methods import sbcd  # noqa: F401  (a package: runner/methods/sbcd/)
from runner.methods.base import METHODS, Method, Privatized, StepOutput, clip_factors  # noqa: F401


def build(cfg) -> Method:
    """The method named by cfg.method.name, with its options (cfg.method) and the run's clip and sigma."""
    return METHODS.build(str(cfg.method.name), cfg=cfg.method, clip=float(cfg.clip), sigma=float(cfg.sigma))
