"""Run the Hydra multirun sweeps behind figures: the preset's grid, then each of its `extra_sweeps`.

    python -m runner.figures.sweep jl_table2 --scale smoke      # dprun -m experiment=jl_table2 scale=smoke ...
    python -m runner.figures.sweep lk_fig5 lk_fig6 --scale paper -- launcher=slurm
    python -m runner.figures.sweep jl_table2 --dry-run          # print the dprun commands only

A preset (conf/experiment/<name>.yaml) sets `hydra.sweeper.params` (its grid; `dprun -m experiment=<name>` alone
runs it) and may list `extra_sweeps`: override strings for arms that are not a product with the grid (JL's r only
for method=jl). Each becomes one `dprun -m experiment=<name> scale=<scale> <extra>` (an extra's keys replace the
grid's). Figures sharing a preset (JL Table 2 and Figure 4) run it once per call.
Arguments after `--` go to every dprun command (e.g. launcher=joblib, device=cuda, data_dir=...). Progress is left
on, so a long job's log (a file, Slurm) has a line with the ETA every 10% of an epoch (at most one per 30 s) and one
per epoch with the run's ETA (runner/progress.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from runner.paths import compose
from runner.figures import FIGURES


def compose_preset(experiment: str, scale: str, extra: list[str] | None = None):
    return compose([f"experiment={experiment}", f"scale={scale}", *(extra or [])], return_hydra_config=True)


def parse(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def sweep_commands(experiment: str, scale: str, passthrough: list[str]) -> list[list[str]]:
    """The dprun argv of each sweep of a preset: its grid, then each extra sweep (whose keys replace the grid's)."""
    cfg = compose_preset(experiment, scale, passthrough)
    grid = {str(k): str(v) for k, v in (cfg.hydra.sweeper.params or {}).items()}
    commands = []
    for extra in [""] + list(cfg.get("extra_sweeps") or []):
        params = {**grid, **dict(map(parse, extra.split()))}
        commands.append([f"experiment={experiment}", f"scale={scale}", *(f"{k}={v}" for k, v in params.items()),
                         *passthrough])  # progress stays on: off a terminal, lines with the ETA
    return commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m runner.figures.sweep", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", help="figure names (python -m runner.plots --list)")
    p.add_argument("--scale", default="smoke", choices=["smoke", "paper"])
    p.add_argument("--dry-run", action="store_true", help="print the dprun commands, run nothing")
    args = p.parse_args(argv)
    experiments, failed = [], 0
    for name in args.names:
        fig = FIGURES.get(name)
        if fig.experiment is None:
            print(f"sweep: {name} is computed (no training); nothing to run")
        elif fig.gpu_only and not args.dry_run and not _cuda():
            print(f"sweep: {name} skipped: GPU only (largest batch before out-of-memory) and CUDA is not available")
        elif fig.study:  # its own sweep (the memory study: bisection, one process per probe)
            cmd = [sys.executable, "-m", fig.study, "--scale", args.scale] + (["--dry-run"] if args.dry_run else [])
            print(f"sweep: python -m {fig.study} --scale {args.scale} -- {' '.join(passthrough)}", flush=True)
            if subprocess.call(cmd + ["--", *passthrough]) != 0:
                failed += 1
        elif fig.experiment not in experiments:
            experiments.append(fig.experiment)
    for experiment in experiments:
        commands = sweep_commands(experiment, args.scale, passthrough)
        for cmd in commands:
            print("sweep: dprun -m " + " ".join(cmd), flush=True)
            if args.dry_run:
                continue
            env = dict(os.environ, DPRUN_FIGURE_SWEEP="1")  # dprun: no "extra_sweeps not run" note here
            rc = subprocess.call([sys.executable, "-m", "runner.cli", "-m", *cmd], env=env)
            if rc != 0:
                failed += 1
                print(f"sweep: a job of `dprun -m {' '.join(cmd)}` failed (exit {rc}); the others ran, "
                      "see their summary.json status in dprun-report", flush=True)
    if failed:
        print(f"sweep: {failed} sweep(s) had failed jobs; the figures use the runs that finished")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
