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
        OmegaConf.register_new_resolver("dprun_dirname", safe_dirname)


def safe_dirname(overrides: str) -> str:
    """A multirun subfolder name: the job's values of the keys swept on the command line (`-m r=1,4 epochs=2`
    -> `r=4`), all of hydra.job.override_dirname if none was (a preset's sweep); characters other than letters,
    digits and `=,.+-_` become `_`, at most 100 characters; `run` when nothing was overridden."""
    import re

    swept = {a.lstrip("+~").split("=", 1)[0] for a in sys.argv[1:]
             if "=" in a and re.search(r",|^[^=]*=\s*(range|choice|glob)\(", a)}
    items = [i for i in str(overrides).split(",") if i.split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(items) if items else str(overrides)
    return re.sub(r"[^A-Za-z0-9=,.+_-]", "_", name)[:100] or "run"


register_resolvers()
CONF_DIR = find_conf_dir()  # runner/conf in a wheel, the repository's conf/ in a checkout


def run(cfg: DictConfig) -> dict:
    from runner.train import train

    out_dir = cfg.out_dir or HydraConfig.get().runtime.output_dir
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    log_file = logging.FileHandler(Path(out_dir) / "dprun.log")  # the run's log (Slurm jobs have no terminal)
    log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(log_file)
    try:
        summary = train(cfg, out_dir)
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    print_result(summary, out_dir, table=_interactive())
    return summary


def _interactive() -> bool:
    """A single run on a terminal: a progress bar while it trains, then the per-epoch table (and no per-epoch log
    lines on the terminal, so the epochs are printed once). Otherwise (a sweep, a log file): one line per epoch as
    it finishes, with the ETA, and no table at the end. dprun.log has the lines either way."""
    try:
        single = HydraConfig.get().mode != RunMode.MULTIRUN
    except ValueError:  # not under Hydra (run() called directly)
        single = True
    return single and sys.stderr.isatty()


class _NoEpochLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "epoch_line", False)


def print_result(summary: dict, out_dir, table: bool = True) -> None:
    import pandas as pd

    if not table:
        final = summary.get("final") or {}
        eps = final.get("epsilon")
        eps_text = f", epsilon {float(eps):.4g}" if eps not in (None, "") else ""
        acc_text = f": test_acc {final['test_acc']:.4f}" if "test_acc" in final else ""
        print(f"dprun: {summary['method']} on {summary['config']['dataset']['name']}{acc_text}{eps_text} -> {out_dir}")
        return
    table = pd.read_csv(Path(out_dir) / "metrics.csv")
    cols = [c for c in ("epoch", "train_loss", "test_acc", "epoch_time_s", "step_time_s") if c in table]
    cols += [c for c in table.columns if c.startswith("epsilon") and table[c].notna().any()]  # + hsa's baseline
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"dprun: {summary['method']} on {summary['config']['dataset']['name']} -> {out_dir}")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[dprun] %(message)s", force=True)
    logging.getLogger("dprun").disabled = False  # hydra/job_logging=disabled disables existing loggers per job
    if _interactive():
        for handler in logging.getLogger().handlers:
            handler.addFilter(_NoEpochLines())
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


def known_keys() -> list[str]:
    """Top-level config keys: config.yaml's, those that global presets and dataset/method files set, the groups."""
    import yaml

    keys = set(CONFIG_GROUPS) | {"hydra", "experiment_tag"}
    for path in Path(CONF_DIR).rglob("*.yaml"):
        text = path.read_text()
        if path.name == "config.yaml" or "@package _global_" in text:
            keys |= set((yaml.safe_load(text) or {}).keys()) - {"defaults"}
    return sorted(keys)


def check_keys(argv: list[str]) -> None:
    """`batchsize=32` or `+batchsize=32` (a new key nothing reads) is refused with one line, not run and ignored."""
    import re

    valid = None
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        first = re.split(r"[./@]", arg.lstrip("+~").split("=", 1)[0])[0]
        valid = valid or known_keys()
        if first not in valid:
            raise DprunError(unknown_name_message("key", first, valid) + " (dprun --help lists them)")


def main() -> None:
    try:
        check_group_choices(sys.argv[1:])
        check_keys(sys.argv[1:])
    except DprunError as e:
        print(f"dprun: {e}", file=sys.stderr)
        sys.exit(2)
    from runner.checkpoint import resume_argv

    sys.argv[1:] = resume_argv(sys.argv[1:])  # resume=<dir>: that run's overrides, continued in its folder
    _hydra_main()


if __name__ == "__main__":
    main()
