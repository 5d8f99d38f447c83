"""Where the config lives and the resolvers it uses: imported by cli.py, figures/sweep.py and the tests, which
compose conf/ (so no module needs to import the CLI for them). Registering is explicit and idempotent:

    from runner.paths import CONF_DIR, register_resolvers
    register_resolvers()          # before composing conf/ with Hydra's compose API
"""
from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from runner.confdir import find_conf_dir
from runner.data.base import default_data_dir

CONF_DIR = find_conf_dir()  # runner/conf in a wheel, the repository's conf/ in a checkout


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


def safe_dirname(overrides: str) -> str:
    """A multirun subfolder name: the job's values of the keys swept on the command line (`-m r=1,4 epochs=2`
    -> `r=4`), all of hydra.job.override_dirname if none was (a preset's sweep); characters other than letters,
    digits and `=,.+-_` become `_`, at most 100 characters; `run` when nothing was overridden."""
    swept = {a.lstrip("+~").split("=", 1)[0] for a in sys.argv[1:]
             if "=" in a and re.search(r",|^[^=]*=\s*(range|choice|glob)\(", a)}
    items = [i for i in str(overrides).split(",") if i.split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(items) if items else str(overrides)
    return re.sub(r"[^A-Za-z0-9=,.+_-]", "_", name)[:100] or "run"
