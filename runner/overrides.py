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


NESTED_GROUPS = ("method", "model", "optimizer", "dataset")  # groups whose own keys are set as `group.key=value`


def default_choices() -> dict[str, str]:
    """conf/config.yaml's defaults list: group -> the option used when the command line names none."""
    import yaml

    defaults = yaml.safe_load((Path(CONF_DIR) / "config.yaml").read_text())["defaults"]
    return {k: str(v) for d in defaults if isinstance(d, dict) for k, v in d.items() if k in CONFIG_GROUPS}


def option_file(group: str, option: str) -> tuple[dict, bool]:
    """conf/<group>/<option>.yaml, parsed, and whether it is a global package (`# @package _global_`)."""
    import yaml

    text = (Path(CONF_DIR) / group / f"{option}.yaml").read_text()
    return yaml.safe_load(text) or {}, "@package _global_" in text


def option_keys(group: str, option: str) -> set[str]:
    """The keys conf/<group>/<option>.yaml sets for `group.` (a global file, as every dataset's: its `group:` block)."""
    data, is_global = option_file(group, option)
    return set((data.get(group) or {}) if is_global else data) - {"defaults"}


def group_overrides(group: str, option: str) -> dict[str, str]:
    """The other groups an option chooses in its defaults list (`- override /optimizer: adam`, dataset=imdb)."""
    data, _ = option_file(group, option)
    return {k.removeprefix("override /"): str(v) for d in data.get("defaults") or [] if isinstance(d, dict)
            for k, v in d.items() if k.startswith("override /")}


def check_group_keys(argv: list[str]) -> None:
    """`method.r=3` under method=nonprivate (a key the chosen option does not have) in one line naming the option's
    keys and the options that have it, before Hydra's multi-line "Key 'r' is not in struct". `+method.x=` (append)
    is the user's explicit choice and passes; an experiment preset may change the groups: left to Hydra; model=auto
    takes the dataset's model: left to Hydra."""
    parser = OverridesParser.create()
    overrides = []
    for arg in argv:
        if arg.startswith("-"):
            continue
        try:
            overrides.append(parser.parse_override(arg))
        except HydraException:
            continue
    chosen = {g: [c] for g, c in default_choices().items()}
    named = set()
    for o in overrides:
        if o.key_or_group in CONFIG_GROUPS and not o.package:
            chosen[o.key_or_group] = chosen_options(o, group_options(o.key_or_group))
            named.add(o.key_or_group)
    for group in ("dataset", "method"):  # their defaults lists may choose other groups the command line did not
        for option in chosen.get(group, []) if len(chosen.get(group, [])) == 1 else []:
            if option in group_options(group):
                chosen.update({g: [c] for g, c in group_overrides(group, option).items() if g not in named})
    if any(c not in ("null", "None") for c in chosen.get("experiment", [])):
        return
    for o in overrides:
        group, dot, key = o.key_or_group.partition(".")
        if not dot or group not in NESTED_GROUPS or o.is_add() or o.is_delete() or o.is_force_add():
            continue
        key = key.split(".")[0]
        for option in chosen.get(group, []):
            if (group == "model" and option == "auto") or option not in group_options(group):
                continue
            keys = option_keys(group, option)
            if key not in keys:
                having = [c for c in group_options(group) if key in option_keys(group, c)]
                where = f"; {key} belongs to {group}={'|'.join(having)}" if having else ""
                raise DprunError(f"{group}.{key} is not an option of {group}={option}; its options: "
                                 f"{', '.join(sorted(keys))}{where}")
