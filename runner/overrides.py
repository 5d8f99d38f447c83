"""One-line errors for unknown config-group options on the command line, before Hydra's multi-line ones.

    check_group_choices(["method=foo"])                          # DprunError: unknown method 'foo' ...; valid: ...
    check_group_choices(["-m", "method=choice(nonprivate,reweight)", "model=glob(mlp*)"])     # fine

The command line is read with Hydra's own override parser, so its sweep syntax (a,b  choice()  glob()  range()
shuffle()  sort()) means here what it means to Hydra. Overrides the parser rejects are left to Hydra, which says
what is wrong with them.
"""
from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from hydra.errors import HydraException

from runner.errors import DprunError
from runner.paths import CONF_DIR
from runner.registry import unknown_name_message

CONFIG_GROUPS = ("dataset", "model", "method", "accountant", "audit", "optimizer", "experiment", "launcher")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def chosen_options(override, valid: list[str]) -> list[str]:
    """The options an override selects: one value, a sweep's values, or the options a glob() matches."""
    value = override.value()
    if isinstance(value, Glob):
        return value.filter(valid)
    if override.is_discrete_sweep():
        return list(override.sweep_string_iterator())
    return [] if value in (None, "") else [str(value)]  # `~group`, `group=null`, `group=`: Hydra's business


def check_group_choices(argv: list[str]) -> None:
    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-"):  # -m, --multirun, --cfg job, ...
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # not an override, or malformed: Hydra reports it
        if override.key_or_group not in CONFIG_GROUPS:
            continue
        valid = group_options(override.key_or_group)
        chosen = chosen_options(override, valid)
        if isinstance(override.value(), Glob) and not chosen:
            raise DprunError(f"{arg} matches no {override.key_or_group}; valid: {', '.join(valid)}")
        for choice in chosen:
            if choice not in valid:
                raise DprunError(unknown_name_message(override.key_or_group, choice, valid))
