"""Where the config lives, the resolvers it uses, and composing it outside `dprun`: imported by cli.py, the
figure sweeps, the studies and the tests (so no module needs to import the CLI for them).

    from runner.paths import CONF_DIR, compose, register_resolvers
    cfg = compose(["method=jl", "r=4"])      # conf/ as `dprun method=jl r=4` sees it (registers the resolvers)
    register_resolvers()                     # before @hydra.main or any other composition of conf/ (idempotent)

CONF_DIR is the package's runner/conf in a wheel (setup.py copies the top-level conf/ there at build time) or, in
a source checkout or editable install, the repository's conf/ (through the link runner/conf -> ../conf, or directly
where a checkout has no links).
"""
from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from runner.data_dir import default_data_dir



def find_conf_dir() -> str:
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"dprun's configs are missing: neither {here / 'conf'} nor {here.parent / 'conf'} "
                            "holds config.yaml (reinstall dprun)")


CONF_DIR = find_conf_dir()


def paper_model(like: str, default: str) -> str:
    """dataset.paper_model of conf/dataset/<like>.yaml (the one place it is written), or default where no config
    exists (dataset=synthetic dataset.like=lsun)."""
    path = Path(CONF_DIR) / "dataset" / f"{like}.yaml"
    if not path.exists():
        return default
    return str(OmegaConf.load(path).dataset.paper_model)


def register_resolvers() -> None:
    """${dprun_data_dir:} the per-user data dir; ${dprun_uid:} a unique run id (never two runs in one folder);
    ${dprun_paper_model:like,default} the paper model of another dataset's config; ${dprun_or:value,default}
    value unless it is null (a shorthand such as the top-level `r` that fills method.r); ${dprun_dirname:...} a
    multirun job's folder name from what was swept."""
    if OmegaConf.has_resolver("dprun_data_dir"):
        return
    OmegaConf.register_new_resolver("dprun_data_dir", default_data_dir)
    OmegaConf.register_new_resolver("dprun_uid", lambda: uuid.uuid4().hex[:6], use_cache=True)
    OmegaConf.register_new_resolver("dprun_paper_model", lambda like, default: paper_model(str(like), str(default)))
    OmegaConf.register_new_resolver("dprun_or", lambda value, default: default if value is None else value)
    OmegaConf.register_new_resolver("dprun_dirname", safe_dirname)


def compose(overrides: list[str], return_hydra_config: bool = False):
    """conf/config.yaml composed with overrides, as `dprun k=v ...` would see it (no run folder is made)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def safe_dirname(overrides: str) -> str:
    """A multirun subfolder name: the job's values of the keys swept on the command line (`-m r=1,4 epochs=2`
    -> `r=4`), all of hydra.job.override_dirname if none was (a preset's sweep); characters other than letters,
    digits and `=,.+-_` become `_`, at most 100 characters; `run` when nothing was overridden."""
    swept = {a.lstrip("+~").split("=", 1)[0] for a in sys.argv[1:]
             if "=" in a and re.search(r",|^[^=]*=\s*(range|choice|glob)\(", a)}
    items = [i for i in str(overrides).split(",") if i.split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(items) if items else str(overrides)
    return re.sub(r"[^A-Za-z0-9=,.+_-]", "_", name)[:100] or "run"
