"""`dprun`: compose conf/ with Hydra, run one training job, print where its outputs went.

    dprun                                        # the demo: digits, MLP, non-private, CPU
    dprun method=jl r=4 dataset=cifar10          # DP-SGD-JL on CIFAR-10 with the JL paper's CNN
    dprun -m model=cnn,mlp dataset=digits        # a Hydra multirun sweep
    dprun method=foo                             # dprun: unknown method 'foo'; valid: ...
"""
from __future__ import annotations

import logging
import sys
import uuid
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.confdir import find_conf_dir
from runner.data.base import default_data_dir
from runner.errors import DprunError
from runner.registry import unknown_name_message

PAPER_MODEL = {"mnist": "bu_cnn", "fmnist": "bu_cnn", "cifar10": "papernot_cnn", "imdb": "bilstm",
               "digits": "mlp", "lsun": "resnet18"}


def register_resolvers() -> None:
    """Resolvers used by conf/: per-user data dir, a unique run id (never two runs in one folder), paper models."""
    if not OmegaConf.has_resolver("dprun_data_dir"):
        OmegaConf.register_new_resolver("dprun_data_dir", default_data_dir)
        OmegaConf.register_new_resolver("dprun_uid", lambda: uuid.uuid4().hex[:6], use_cache=True)
        OmegaConf.register_new_resolver("dprun_paper_model", lambda like: PAPER_MODEL.get(str(like), "mlp"))


register_resolvers()
CONF_DIR = find_conf_dir()  # runner/conf in a wheel, the repository's conf/ in a checkout


def run(cfg: DictConfig) -> dict:
    from runner.train import train

    out_dir = cfg.out_dir or HydraConfig.get().runtime.output_dir
    summary = train(cfg, out_dir)
    print_result(summary, out_dir)
    return summary


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


CONFIG_GROUPS = ("dataset", "model", "method", "accountant", "optimizer", "experiment", "launcher")
LAUNCHER_PLUGINS = {"joblib": "hydra_plugins.hydra_joblib_launcher", "submitit_local": "hydra_plugins.hydra_submitit_launcher",
                    "slurm": "hydra_plugins.hydra_submitit_launcher"}  # the `launchers` extra


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package (hydra_plugins) is absent
        return False


def check_group_choices(argv: list[str]) -> None:
    """One-line errors for unknown config-group options (`method=foo`), before Hydra's multi-line ones.

    Accepts sweeps (`method=a,b`) and the `+`/`~` prefixes; other overrides are left to Hydra."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in CONFIG_GROUPS or value in ("", "null"):
            continue
        valid = sorted(p.stem for p in (Path(CONF_DIR) / key).glob("*.yaml"))
        for choice in value.split(","):
            if choice not in valid:
                raise DprunError(unknown_name_message(key, choice, valid))
            if key == "launcher" and choice in LAUNCHER_PLUGINS:
                if not _importable(LAUNCHER_PLUGINS[choice]):
                    raise DprunError(f"launcher={choice} needs its Hydra plugin: pip install 'dprun[launchers]' "
                                     "(or -e '.[launchers]' in a checkout)")


def main() -> None:
    try:
        check_group_choices(sys.argv[1:])
    except DprunError as e:
        print(f"dprun: {e}", file=sys.stderr)
        sys.exit(2)
    from runner.checkpoint import resume_argv

    sys.argv[1:] = resume_argv(sys.argv[1:])  # resume=<dir>: that run's overrides, continued in its folder
    _hydra_main()


if __name__ == "__main__":
    main()
