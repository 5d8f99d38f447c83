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
    for arg, override in parsed_overrides(argv):  # (not an override, or malformed: Hydra reports it)
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
    is the user's explicit choice and passes; an experiment preset may change the groups: left to Hydra. model=auto
    has no knobs of its own (it builds the dataset's paper model with the dataset's): `model.depth=3` there asks
    for a named model."""
    overrides = [o for _, o in parsed_overrides(argv)]
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
            if option not in group_options(group):
                continue
            keys = option_keys(group, option)
            if key not in keys:
                having = [c for c in group_options(group) if key in option_keys(group, c)]
                where = f"; {key} belongs to {group}={'|'.join(having)}" if having else ""
                if group == "model" and option == "auto":  # its knobs are the dataset's, so name the model
                    raise DprunError(f"model.{key} needs a named model: model=auto builds the dataset's paper model "
                                     f"with the dataset's knobs{where} (e.g. model={(having or ['mlp'])[0]} "
                                     f"{o.input_line})")
                raise DprunError(f"{group}.{key} is not an option of {group}={option}; its options: "
                                 f"{', '.join(sorted(keys))}{where}")


def parsed_overrides(argv: list[str]) -> list[tuple[str, object]]:
    """(arg, Hydra's parsed override) for each key=value of the command line; flags and what the parser rejects
    (Hydra reports it) are left out."""
    parser, parsed = OverridesParser.create(), []
    for arg in argv:
        if arg.startswith("-"):
            continue
        try:
            parsed.append((arg, parser.parse_override(arg)))
        except HydraException:
            continue
    return parsed


def check_sweeps(argv: list[str]) -> None:
    """`r=1,4` without -m: one line saying how to sweep, not Hydra's multi-line "Ambiguous value"."""
    if {"-m", "--multirun"} & set(argv):
        return
    for arg, o in parsed_overrides(argv):
        if o.is_sweep_override():
            raise DprunError(f"{arg} is a sweep (one run per value): add -m to run it (dprun -m ... {arg}); a list "
                             f"value is written in brackets, {o.key_or_group}=[a,b]")


def experiment_scales(experiment: str | None) -> list[str]:
    """The scales conf/experiment/<experiment>.yaml defines (its `scales:` keys), or every preset's for None."""
    import yaml

    names = [experiment] if experiment else group_options("experiment")
    scales: dict[str, None] = {}
    for name in names:
        scales.update(dict.fromkeys(yaml.safe_load((Path(CONF_DIR) / "experiment" / f"{name}.yaml").read_text())
                                    .get("scales") or {}))
    return list(scales)


def check_scale(argv: list[str]) -> None:
    """scale=huge: one line naming the preset's scales, before Hydra fails to resolve ${scales.huge.*} (a traceback
    from its own error formatter)."""
    parsed = parsed_overrides(argv)
    scales = [v for _, o in parsed if o.key_or_group == "scale" for v in chosen_options(o, [])]
    experiments = [e for _, o in parsed if o.key_or_group == "experiment"
                   for e in chosen_options(o, group_options("experiment")) if e not in ("null", "None")]
    for experiment in experiments or [None]:  # no preset: any preset's scale (scale is only read by presets)
        valid = experiment_scales(experiment)
        for scale in scales:
            if valid and scale not in valid:
                where = f" (experiment={experiment})" if experiment else ""
                raise DprunError(unknown_name_message("scale", scale, valid) + where)


def check_noise(argv: list[str]) -> None:
    """sigma= with target_epsilon=: the calibration would replace the sigma asked for without a word."""
    given = {o.key_or_group: (arg, o) for arg, o in parsed_overrides(argv) if not o.is_delete()}
    if "sigma" in given and "target_epsilon" in given:
        (sigma, _), (target, o) = given["sigma"], given["target_epsilon"]
        if any(v not in ("null", "None") for v in chosen_options(o, [])):
            raise DprunError(f"{sigma} and {target} both set the noise: target_epsilon calibrates sigma to reach it; "
                             f"give one of them")
