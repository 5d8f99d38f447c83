"""Where the Hydra configs are: inside the installed package (a wheel: runner/conf/, copied from the top-level
conf/ at build time by setup.py) or, in a source checkout or editable install, the repository's conf/."""
from __future__ import annotations

from pathlib import Path


def find_conf_dir() -> str:
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"dprun's configs are missing: neither {here / 'conf'} nor {here.parent / 'conf'} "
                            "holds config.yaml (reinstall dprun)")
