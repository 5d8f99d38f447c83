"""Packaging detail that pyproject.toml cannot say: the configs in the top-level conf/ (the source of truth, edited
in place) ship inside the package as runner/conf/, so a wheel install finds them (runner/paths.py).

runner/conf is a link to ../conf, so every package lies where its name says under the checkout root, and
package_dir={"": "."} says so: then `pip install -e .` puts the checkout root on sys.path (a plain .pth line) instead
of setuptools' import hook, which Python asks only after its own path search. With the hook, a script beside the
clone's folder (named dprun) imported that folder as an empty namespace package: `dprun.make_private` was missing."""
from pathlib import Path

from setuptools import find_packages, setup

conf_groups = sorted(d.name for d in (Path(__file__).parent / "conf").iterdir() if d.is_dir())
setup(
    packages=find_packages(include=["runner", "runner.*", "dprun"]) + ["runner.conf"] + [f"runner.conf.{g}" for g in conf_groups],
    package_dir={"": "."},
    package_data={"runner.conf": ["*.yaml"], **{f"runner.conf.{g}": ["*.yaml"] for g in conf_groups}},
)
