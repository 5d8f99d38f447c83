"""Packaging detail that pyproject.toml cannot say: the configs in the top-level conf/ (the source of truth, edited
in place) ship inside the package as runner/conf/, so a wheel install finds them (runner/paths.py)."""
from pathlib import Path

from setuptools import find_packages, setup

conf_groups = sorted(d.name for d in (Path(__file__).parent / "conf").iterdir() if d.is_dir())
setup(
    packages=find_packages(include=["runner", "runner.*", "dprun"]) + ["runner.conf"] + [f"runner.conf.{g}" for g in conf_groups],
    package_dir={"runner.conf": "conf"},
    package_data={"runner.conf": ["*.yaml"], **{f"runner.conf.{g}": ["*.yaml"] for g in conf_groups}},
)
