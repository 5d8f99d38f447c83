"""`dprun`: compose conf/ with Hydra, run one training job, print where its outputs went.

    dprun                                        # the demo: digits, MLP, non-private, CPU
    dprun method=jl r=4 dataset=cifar10          # DP-SGD-JL on CIFAR-10 with the JL paper's CNN
    dprun -m model=cnn,mlp dataset=digits        # a Hydra multirun sweep
    dprun method=foo                             # dprun: unknown method 'foo'; valid: ...
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.errors import DprunError
from runner.interrupt import interrupted_exit, sigterm_as_interrupt
from runner.overrides import check_group_choices
from runner.paths import CONF_DIR, register_resolvers
from runner.run_dir import check_reused_dirs

register_resolvers()  # before @hydra.main composes conf/


def run(cfg: DictConfig) -> dict:
    from runner.train import train

    out_dir = output_dir(cfg)
    with sigterm_as_interrupt():  # SIGTERM (timeout, Slurm) ends the run like Ctrl-C: status `interrupted`
        summary = train(cfg, out_dir)
    print_result(summary, out_dir)
    return summary


def output_dir(cfg: DictConfig) -> str:
    return cfg.out_dir or HydraConfig.get().runtime.output_dir


def print_result(summary: dict, out_dir) -> None:
    import pandas as pd

    table = pd.read_csv(Path(out_dir) / "metrics.csv")
    cols = [c for c in ("epoch", "train_loss", "test_acc", "epoch_time_s", "step_time_s") if c in table]
    cols += [c for c in table.columns if c.startswith("epsilon") and table[c].notna().any()]  # + hsa's baseline
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"dprun: {summary['method']} on {summary['config']['dataset']['name']} -> {out_dir}")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[dprun] %(message)s", force=True)
    try:
        run(cfg)
    except DprunError as e:
        print(f"dprun: {e}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # a sweep goes on with its other jobs; Hydra reports the failed one at the end
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the complete epochs are on disk; one line, no traceback
        line, code = interrupted_exit(e, output_dir(cfg))
        print(line, file=sys.stderr)
        sys.exit(code)


def extra_sweeps_note(argv: list[str]) -> str | None:
    """One line when `dprun -m experiment=X` runs only X's grid while X also lists `extra_sweeps` (arms outside the
    grid, e.g. JL's r), which `make fig-X` runs as well; None otherwise (and inside runner.figures.sweep)."""
    import os

    if not {"-m", "--multirun"} & set(argv) or os.environ.get("DPRUN_FIGURE_SWEEP"):
        return None
    exp = next((a.partition("=")[2] for a in argv if a.startswith("experiment=")), None)
    path = Path(CONF_DIR) / "experiment" / f"{exp}.yaml"
    if not exp or not path.exists() or "extra_sweeps" not in OmegaConf.load(path):
        return None
    scale = next((a.partition("=")[2] for a in argv if a.startswith("scale=")), "smoke")
    return (f"dprun: note: this runs experiment={exp}'s grid only; its extra_sweeps (arms outside the grid) run with "
            f"`make fig-{exp} SCALE={scale}` (python -m runner.figures.sweep {exp} --scale {scale})")


def main() -> None:
    note = extra_sweeps_note(sys.argv[1:])
    if note:
        print(note, file=sys.stderr)
    try:
        check_group_choices(sys.argv[1:])
        check_reused_dirs(sys.argv[1:])
    except DprunError as e:
        print(f"dprun: {e}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
