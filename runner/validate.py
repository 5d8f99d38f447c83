"""Every top-level knob checked before any data is loaded: one table of knob -> rule, one line per bad value.
The model's knobs likewise (MODEL_RULES: one rule per knob name, whichever model has it).

    from runner.validate import validate_config
    validate_config(cfg)    # DprunError: lr=nan must be a finite number > 0

train() calls it first, so a bad value never trains an epoch (or reports "finished") before failing. Hydra gives
a value the type it parses (`batch_size=abc` is the string 'abc'), so each rule converts and checks the value.
Checks that need the data (batch_size <= N) or the mechanism (the jl accountant at q = 1, pld at tiny sigma)
live where that is known: runner/data/sampler.py and runner/accountants/.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner import models
from runner.data.sampler import SAMPLINGS
from runner.models.mlp import ACTIVATIONS
from runner.models.resnet import STEMS
from runner.models.rnn import INITS
from runner.randomness import RNGS
from runner.errors import DprunError
from runner.methods.base import CLIP_RANGE, CLIP_TEXT, SCALE_RANGE, SCALE_TEXT
from runner.optimizers import IMPLS
from runner.paths import CONF_DIR

Rule = Callable[[Any], str | None]  # value -> None if fine, else what is accepted ("an integer >= 1")


def _as_int(value: Any) -> int | None:
    """An integer value (1, '1', 64.0), else None. Booleans are not integers here (`epochs=true` is a typo)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return int(str(value))
    except ValueError:
        return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(str(value))
    except ValueError:
        return None


def integer(low: int | None = None, high: int | None = None) -> Rule:
    def rule(value):
        v = _as_int(value)
        if v is None or (low is not None and v < low) or (high is not None and v > high):
            if high is not None:
                return f"an integer in [{low}, {high}]"
            return "an integer" + (f" >= {low}" if low is not None else "")
        return None
    return rule


def number(low: float, low_open: bool, high: float = math.inf, high_open: bool = True) -> Rule:
    """A finite float in an interval; nan and inf are refused (nan compares false with everything)."""
    def rule(value):
        v = _as_float(value)
        inside = v is not None and math.isfinite(v) and (v > low if low_open else v >= low) and (
            v < high if high_open else v <= high)
        if inside:
            return None
        if high == math.inf:
            return f"a finite number {'>' if low_open else '>='} {low:g}"
        return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return rule


def at_most(rule: Rule, high: float, why: str) -> Rule:
    """`rule`, and at most `high` (a bound only huge values meet, named only to them: lr=1e308)."""
    def check(value):
        what = rule(value)
        if what is None and _as_float(value) > high:
            return f"{rule(math.nan)} and <= {high:.17g} ({why})"
        return what
    return check


def one_of(*choices: str) -> Rule:
    def rule(value):
        return None if str(value) in choices else "one of: " + ", ".join(choices)
    return rule


def device(value) -> str | None:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked when the device is built)."""
    return None if re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(value)) else "one of: auto, cpu, cuda, cuda:N"


def boolean(value) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def betas(value) -> str | None:
    """Adam's (beta1, beta2): two numbers in [0, 1)."""
    try:
        pair = [float(b) for b in value]
    except (TypeError, ValueError):
        pair = []
    ok = len(pair) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in pair)
    return None if ok else "two numbers in [0, 1), e.g. [0.9,0.999]"


def widths(value) -> str | None:
    """Layer widths: a non-empty list of integers >= 1 (a width of 0 builds a layer with no units)."""
    ok = not isinstance(value, (str, bool)) and hasattr(value, "__len__") and len(value) > 0 and all(
        integer(1)(v) is None for v in value)
    return None if ok else "a non-empty list of integers >= 1, e.g. [128,256]"


def optional(rule: Rule) -> Rule:
    """null is allowed (the knob is off), else `rule`."""
    def check(value):
        if value is None:
            return None
        what = rule(value)
        return None if what is None else f"null or {what}"
    return check


FLOAT32_MAX = 3.4028234663852886e38  # torch's optimizers take lr, momentum, weight_decay, eps as float32 scalars
FLOAT32_WHY = "float32's largest: torch's optimizer takes it as a float32"
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)  # what torch.manual_seed and torch.Generator.manual_seed accept
TIMEOUT_MAX = 86400 * 999_999_999  # datetime.timedelta's largest span, in seconds (the process group's timeout)

# knob -> rule. The ranges are where the run means something: clip <= 0 freezes the model or ascends the loss,
# sigma < 0 is not a noise level, delta must be a probability strictly inside (0, 1) for epsilon(delta) to exist.
RULES: dict[str, Rule] = {
    "batch_size": integer(1),
    "eval_batch_size": integer(1),
    "epochs": integer(1),
    "max_steps_per_epoch": optional(integer(1)),
    "max_eval_batches": optional(integer(1)),  # -1 evaluated no example at all: test_acc 0 on a "finished" run
    "warmup_steps": integer(0),
    "seed": integer(*SEED_RANGE),
    "rng": one_of(*RNGS),  # seeded | secure (runner/randomness.py)
    "r": optional(integer(1)),  # the bare r= alias of method.r (null: method=jl's own default)
    "lr": at_most(number(0, low_open=True), FLOAT32_MAX, FLOAT32_WHY),
    "clip": number(0, low_open=True),
    "sigma": number(0, low_open=False),  # sigma = 0: no noise, epsilon = inf (docs/privacy.md)
    "delta": number(0, low_open=True, high=1, high_open=True),
    "target_epsilon": optional(number(0, low_open=True)),
    "calibration_accountant": optional(one_of("auto", "pld", "rdp", "gdp", "jl")),  # null: a certified one
    "device": device,
    "dtype": one_of("float32", "float64"),
    "precision": one_of("fp32", "bf16", "tf32"),  # fp16 (loss scaling) is not supported: refused here
    "physical_batch_size": optional(integer(1)),
    "distributed.backend": one_of("auto", "gloo", "nccl"),
    "distributed.nproc_per_node": integer(1),
    "distributed.timeout_s": at_most(number(0, low_open=True), TIMEOUT_MAX, "a timedelta's largest span"),
    "sampling": one_of(*SAMPLINGS),
    "progress": boolean,
    "step_timing": one_of("sync", "epoch"),
    "log_norms": boolean,
    "checkpoint": boolean,
    "privacy_check": boolean,
    "optimizer.momentum": at_most(number(0, low_open=False), FLOAT32_MAX, FLOAT32_WHY),
    "optimizer.weight_decay": at_most(number(0, low_open=False), FLOAT32_MAX, FLOAT32_WHY),
    "optimizer.eps": at_most(number(0, low_open=True), FLOAT32_MAX, FLOAT32_WHY),
    "optimizer.betas": betas,
    "optimizer.impl": one_of(*IMPLS),
    "audit.canaries": integer(2),  # halves: one picks the number of guesses, the other is bounded
    "audit.canary": one_of("gradient", "input", "adversarial"),
    "audit.confidence": number(0.5, low_open=True, high=1, high_open=True),  # review 63: at or below 1/2 the
    # flag's false-alarm rate 2 beta promises nothing
    "audit.direction": one_of("dirac", "random"),
    "audit.score": one_of("steps", "sum"),
    # dataset=synthetic's sizes (null: the real dataset's); 0 examples or tokens is no dataset
    "dataset.train_size": optional(integer(1)),
    "dataset.test_size": optional(integer(1)),
    "dataset.seq_len": optional(integer(1)),
    "dataset.image_size": optional(integer(1)),
}
# model.<knob> -> rule, for every model that has the knob (a knob means the same in each family: runner/models/).
# Checked where set (null: the builder's default); a 0 or negative size divided by zero or built an empty layer.
MODEL_RULES: dict[str, Rule] = {
    "depth": integer(0),  # hidden layers of the MLP; 0: a linear classifier
    "widths": widths,
    "hidden": integer(1),
    "kernel": integer(1),
    "last_width": integer(1),
    "embed_dim": integer(1),
    "d_model": integer(1),
    "heads": integer(1),
    "ff": integer(1),
    "layers": integer(1),
    "pool_size": integer(1),
    "dense": integer(0),  # 0: no Dense layer before the output
    "fc_width": integer(0),  # 0: a single Linear classifier
    "dropout": number(0, low_open=False, high=1, high_open=True),
    "activation": one_of(*ACTIVATIONS),
    "init": one_of(*INITS),
    "stem": one_of(*STEMS),
    "bidirectional": boolean,
    "double_bias": boolean,
    "mask_padding": boolean,
    "freeze_embedding": boolean,
}
OPTION_GROUPS = ("method", "optimizer", "dataset")  # group -> its options are the keys of conf/<group>/<name>.yaml
_ABSENT = object()


def validate_config(cfg: DictConfig) -> None:
    """Raise DprunError naming the first bad knob, its value and what is accepted."""
    for knob, rule in RULES.items():
        value = OmegaConf.select(cfg, knob, default=_ABSENT)
        if value is _ABSENT:
            continue
        accepted = rule(value)
        if accepted is not None:
            raise DprunError(f"{knob}={as_typed(value)} is not valid: {knob} must be {accepted}")
    check_noise_scale(cfg)
    if str(cfg.get("precision", "fp32")) == "bf16" and str(cfg.get("dtype", "float32")) != "float32":
        raise DprunError(f"precision=bf16 needs dtype=float32 (autocast runs bfloat16 copies of float32 weights), "
                         f"got dtype={cfg.dtype}")
    for group in OPTION_GROUPS:
        if isinstance(cfg.get(group), DictConfig) and cfg[group].get("name"):
            keys = set(cfg[group].keys())
            if group == "dataset" and "like" in keys:  # a preset's one block for both scales: synthetic data
                # shaped like dataset.like at smoke scale, that dataset itself at paper scale
                keys -= (group_options("dataset", "synthetic") or set()) | (
                    group_options("dataset", str(cfg.dataset.like)) or set())
            check_options(group, str(cfg[group].name), keys)
    if not cfg.get("resume"):  # a resumed run keeps its recorded config (runs before method.r recorded r=1 for all)
        check_r(cfg)
    if isinstance(cfg.get("model"), DictConfig) and cfg.model.get("name"):
        check_model(cfg)


def check_noise_scale(cfg: DictConfig) -> None:
    """clip, and sigma * clip where sigma > 0, inside the range a method accepts (runner/methods/base.py
    CLIP_RANGE, SCALE_RANGE: near float32's limits the clipped gradients and the noise are rounded; a subnormal clip released no
    noise at all). With target_epsilon the calibration chooses sigma: the method checks the one it sets."""
    clip, sigma = _as_float(cfg.get("clip", 1.0)), _as_float(cfg.get("sigma", 0.0))
    if clip is None or sigma is None:  # (RULES said what is wrong with them)
        return
    low, high = SCALE_RANGE
    if not CLIP_RANGE[0] <= clip <= CLIP_RANGE[1]:
        raise DprunError(f"clip={as_typed(cfg.clip)} is not valid: clip must be a number in {CLIP_TEXT} (near "
                         f"float32's limits the clipped gradients and the noise scaled to it are rounded; below 1e-6 "
                         f"the clipped sums' rounding is not covered by the clip bound)")
    if sigma > 0 and cfg.get("target_epsilon") is None and not low <= sigma * clip <= high:
        raise DprunError(f"sigma={as_typed(cfg.sigma)} with clip={as_typed(cfg.clip)} is not valid: the noise std "
                         f"sigma * clip = {sigma * clip:g} must be in {SCALE_TEXT} (near float32's limits it is "
                         f"rounded to 0 or overflows to inf), or sigma=0 (no noise, epsilon = inf)")


def check_r(cfg: DictConfig) -> None:
    """The bare r= is a shorthand for method.r: refused where nothing reads it or method.r says otherwise."""
    r, method = cfg.get("r"), cfg.get("method")
    if r is None or not isinstance(method, DictConfig):
        return
    if "r" not in method:
        raise DprunError(f"r={r} is not valid: r is method=jl's JL dimension (method.r) and "
                         f"method={method.get('name')} has no r; drop r= or use method=jl")
    if str(method.r) != str(r):
        raise DprunError(f"r={r} and method.r={method.r} disagree: r= is a shorthand for method.r; give one of them")


def check_model(cfg: DictConfig) -> None:
    """The model: one its method can train, options its builder has, values MODEL_RULES accepts, heads | d_model."""
    given = OmegaConf.to_container(cfg.model, resolve=True)
    name = str(given.pop("name"))
    given.update(given.pop("kwargs", None) or {})  # model=auto: the dataset's knobs for its paper model
    method = str(OmegaConf.select(cfg, "method.name", default=""))
    needs = method_model(method)
    if needs and name != needs:  # before the options: its preset's model.depth etc. are not the other model's
        raise DprunError(f"method={method} trains only a model built from model={needs} (conf/method/{method}.yaml "
                         f"chooses it); got model={name}: add model={needs}")
    values = models.knobs(name, **given)  # an option the builder lacks: one line naming its options
    for knob, value in given.items():
        accepted = MODEL_RULES[knob](value) if knob in MODEL_RULES and value is not None else None
        if accepted is not None:
            raise DprunError(f"model.{knob}={as_typed(value)} is not valid: model.{knob} must be {accepted}")
    if "heads" in values and int(values["d_model"]) % int(values["heads"]):  # each head gets d_model/heads dims
        d = int(values["d_model"])
        divisors = ", ".join(str(h) for h in range(1, d + 1) if d % h == 0)
        raise DprunError(f"model.heads={values['heads']} does not divide model.d_model={d} (each head attends over "
                         f"d_model/heads of the width): heads must be one of: {divisors}")


def method_model(method: str) -> str | None:
    """The model a method trains only, as its config chooses it (conf/method/sbcd.yaml: `override /model: mlp`)."""
    from runner.overrides import group_overrides  # (Hydra's parser: not for the library's `import dprun`)

    if not (Path(CONF_DIR) / "method" / f"{method}.yaml").exists():
        return None
    return group_overrides("method", method).get("model")


def group_options(group: str, name: str) -> set[str] | None:
    """The options of conf/<group>/<name>.yaml (its `<group>:` block when it is packaged `_global_`, as the dataset
    files and sbcd's are), None where there is no file."""
    path = Path(CONF_DIR) / group / f"{name}.yaml"
    if not path.exists():
        return None
    data = OmegaConf.load(path)
    if "@package _global_" in path.read_text():
        data = data.get(group) or {}
    return {str(k) for k in data.keys()}


def check_options(group: str, name: str, keys) -> None:
    """`+method.foo=3` or make_private(method_options={"fo": 1}) is refused in one line, never run and ignored."""
    valid = group_options(group, name)
    unknown = sorted({str(k) for k in keys} - (valid or set()))
    if valid is not None and unknown:
        listed = ", ".join(sorted(valid - {"name"})) or "none"
        raise DprunError(f"unknown option {group}.{unknown[0]} for {group}={name}; its options: {listed} "
                         f"(conf/{group}/{name}.yaml)")


def as_typed(value: Any) -> str:
    """The value as written on the command line: true, null, 'abc' (quoted: a string where a number belongs)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, str) else str(value)
