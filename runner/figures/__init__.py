"""The three works' tables and figures: one file per paper registers its Figure specs in FIGURES.

    from runner.figures import FIGURES
    FIGURES.names()          # jl_fig2, jl_table2, lk_fig5, sbcd_hsa_vs_composition, ...

runner/figures/sweep.py runs a figure's preset sweep; runner/plots.py draws figures from dprun-report's tables.
"""
from __future__ import annotations

from runner.figures import jl, lee_kifer, sbcd  # noqa: F401  (each registers its figures)
from runner.figures.spec import FIGURES, Figure  # noqa: F401
