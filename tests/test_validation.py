"""Bad input is refused before any data is loaded, with one line naming the knob (issue 10, "Bad input").

Most cases call train() in-process with a data loader that fails the test if it is ever called, so they are fast
and prove the "before any data is loaded" part; a few go through the `dprun` command (exit 2, one stderr line,
no metrics.csv). Accountant guards are tested on the accountants, where library users meet them too.
"""
from __future__ import annotations

import json
import math
import re

import pytest

from conftest import compose_config, dprun_in_process
from test_cli import dprun, one_line_error

import runner.train
from runner import accountants
from runner.errors import DprunError

TINY = ["dataset=digits", "epochs=1", "max_steps_per_epoch=2", "progress=false"]

# (override, what the error line must contain besides the knob's name). Each of these trained (or crashed after
# loading the data) before the validator: see the before/after table in the issue note.
BAD_KNOBS = [
    ("clip=0", "> 0"), ("clip=-1", "> 0"), ("lr=nan", "> 0"), ("lr=-1", "> 0"), ("lr=inf", "finite"),
    ("max_steps_per_epoch=-1", ">= 1"), ("max_steps_per_epoch=0", ">= 1"),
    ("sigma=-1", ">= 0"), ("delta=0", "(0, 1)"), ("delta=2", "(0, 1)"),
    ("batch_size=abc", "integer"), ("batch_size=0", ">= 1"), ("batch_size=1.5", "integer"),
    ("dtype=float16", "float32"), ("epochs=0", ">= 1"), ("epochs=true", "integer"),
    ("seed=abc", "integer"), ("warmup_steps=-1", ">= 0"), ("eval_batch_size=0", ">= 1"),
    ("target_epsilon=0", "> 0"), ("target_epsilon=-1", "> 0"), ("r=0", ">= 1"), ("r=2.5", "integer"),
    ("sampling=random", "poisson"), ("progress=maybe", "true or false"),
    ("max_eval_batches=-1", ">= 1"), ("max_eval_batches=0", ">= 1"), ("checkpoint=maybe", "true or false"),
    # nested knobs: each ended in a torch traceback after the data was loaded
    ("optimizer.momentum=-1", ">= 0"), ("optimizer.weight_decay=-1", ">= 0"), ("optimizer.impl=fast", "foreach"),
    # past float32's largest value: torch's SGD crashed ("cannot be converted to type float without overflow")
    ("lr=1e+308", "<= 3.4028234663852886e+38"), ("optimizer.weight_decay=1e+39", "<= 3.4028234663852886e+38"),
    ("optimizer.momentum=1e+39", "<= 3.4028234663852886e+38"),
    # outside what torch.manual_seed takes: "Overflow when unpacking long long" after the folder was made
    ("seed=18446744073709551616", "[-9223372036854775808, 18446744073709551615]"),
    ("seed=-9223372036854775809", "[-9223372036854775808, 18446744073709551615]"),
]


# (overrides, the error line's start, what it must also contain). Each crashed with a traceback after the data was
# loaded (KeyError, ZeroDivisionError, ValueError, a torch RuntimeError), or trained something meaningless.
BAD_MODEL_AND_DATA = [
    (["model=mlp", "model.activation=foo"], "model.activation='foo'", "one of: sigmoid, relu, tanh"),
    (["model=cnn", "model.kernel=0"], "model.kernel=0", "an integer >= 1"),
    (["model=lstm", "model.hidden=0"], "model.hidden=0", "an integer >= 1"),
    (["model=lstm", "model.init=foo"], "model.init='foo'", "one of: torch, keras"),
    (["model=transformer", "model.heads=3"], "model.heads=3", "model.d_model=200"),
    (["model=transformer", "model.d_model=7"], "model.heads=8", "heads must be one of: 1, 7"),
    (["model=mlp", "model.widths=[0]"], "model.widths=[0]", "non-empty list of integers >= 1"),
    (["model=mlp", "model.depth=-1"], "model.depth=-1", "an integer >= 0"),
    (["dataset=synthetic", "dataset.like=imdb", "dataset.seq_len=0"], "dataset.seq_len=0", "null or an integer >= 1"),
    (["dataset=synthetic", "dataset.train_size=0"], "dataset.train_size=0", "null or an integer >= 1"),
    # the model sbcd trains, named before its preset's model.depth is "unknown option model.depth for model=cnn"
    (["method=sbcd", "model=cnn"], "method=sbcd trains only a model built from model=mlp", "got model=cnn"),
    # the bare r= is method.r: ignored by other methods, overruled by method.r
    (["method=nxbp", "r=4"], "r=4 is not valid", "method=nxbp has no r"),
    (["method=jl", "method.r=3", "r=5"], "r=5 and method.r=3 disagree", "give one of them"),
]


@pytest.fixture
def no_data(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("data was loaded before the bad knob was refused")
    monkeypatch.setattr(runner.train, "load_dataset", refuse)


@pytest.mark.parametrize("override,accepted", BAD_KNOBS, ids=[o for o, _ in BAD_KNOBS])
def test_bad_knob_is_refused_before_any_data_is_loaded(tmp_path, no_data, override, accepted):
    knob, value = override.split("=")
    cfg = compose_config(TINY + [override])
    with pytest.raises(DprunError) as err:
        runner.train.train(cfg, tmp_path / "run")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{knob}=") and value in line and accepted in line
    assert not (tmp_path / "run").exists()  # no run folder, no metrics.csv


@pytest.mark.parametrize("overrides,line", [
    (["clip=1e-40"], "clip=1e-40 is not valid: clip must be a number in [1e-6, 1e30] (near float32's limits"),
    (["clip=1e-7"], "clip=1e-07 is not valid: clip must be a number in [1e-6, 1e30]"),  # review 64
    (["clip=1e31"], "clip=1e+31 is not valid: clip must be a number in [1e-6, 1e30]"),
    (["clip=1e20", "sigma=1e20"], "sigma=1e+20 with clip=1e+20 is not valid: the noise std sigma * clip = 1e+40 must "
                                  "be in [1e-30, 1e30]"),
    (["sigma=1e-31"], "sigma=1e-31 with clip=1.0 is not valid: the noise std sigma * clip = 1e-31 must be in "
                      "[1e-30, 1e30]"),
])
def test_a_clip_or_noise_std_near_float32s_limits_is_refused_before_any_data_is_loaded(tmp_path, no_data, overrides,
                                                                                          line):
    """The range make_private's method refuses (runner/methods/base.py SCALE_RANGE): C = 1e-44 trained with a noise
    std of exactly 0 while the accountant certified an epsilon; sigma * C = 1e40 overflowed after the step."""
    with pytest.raises(DprunError) as err:
        runner.train.train(compose_config(TINY + overrides), tmp_path / "run")
    assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", [["clip=1e-6"], ["clip=1e30"], ["clip=1e-6", "sigma=0"],
                                       ["clip=1e20", "sigma=1e20", "target_epsilon=3"]])
def test_the_edges_of_the_clip_range_pass_the_validator(overrides):
    """sigma=0 (no noise) needs only C in range; with target_epsilon the calibration sets sigma (the method checks)."""
    from runner.validate import validate_config

    validate_config(compose_config(overrides))


@pytest.mark.parametrize("overrides,start,accepted", BAD_MODEL_AND_DATA, ids=[" ".join(o) for o, _, _ in BAD_MODEL_AND_DATA])
def test_bad_model_and_dataset_values_are_refused_before_any_data_is_loaded(tmp_path, no_data, overrides, start,
                                                                              accepted):
    with pytest.raises(DprunError) as err:
        runner.train.train(compose_config(["epochs=1", "progress=false", *overrides]), tmp_path / "run")
    line = str(err.value)
    assert "\n" not in line and line.startswith(start) and accepted in line, line
    assert not (tmp_path / "run").exists()


def test_every_model_knob_has_a_rule_its_default_passes():
    """MODEL_RULES is the one place a model knob's values are checked: a new knob gets its rule there."""
    from runner import models
    from runner.validate import MODEL_RULES

    checked_elsewhere = {"norm_groups", "glove_path", "vocab_path"}  # models.base.group_count; files, when read
    for name in models.MODELS.names():
        for knob, default in models.knobs(name).items():
            assert knob in MODEL_RULES or knob in checked_elsewhere, f"model={name}: no rule for model.{knob}"
            assert knob not in MODEL_RULES or MODEL_RULES[knob](default) is None, f"model={name}: {knob}={default}"


def test_a_bad_model_value_on_the_command_line_is_one_line_and_leaves_no_folder(tmp_path):
    proc = dprun_in_process("model=mlp", "model.activation=foo", "epochs=1", cwd=tmp_path)
    assert one_line_error(proc) == ("dprun: model.activation='foo' is not valid: model.activation must be one of: "
                                    "sigmoid, relu, tanh")
    # it used to leave a run folder with the traceback in its dprun.log (now: Hydra's empty date folder at most)
    assert not [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()]


@pytest.mark.parametrize("args,line", [
    (["experiment=jl_fig3", "scale=huge"], "dprun: unknown scale 'huge'; valid: smoke, paper (experiment=jl_fig3)"),
    (["-m", "experiment=jl_fig3", "scale=huge"], "dprun: unknown scale 'huge'; valid: smoke, paper (experiment=jl_fig3)"),
    (["method=jl", "r=1,4"], "dprun: r=1,4 is a sweep (one run per value): add -m to run it (dprun -m ... r=1,4); "
                             "a list value is written in brackets, r=[a,b]"),
    (["sigma=2", "target_epsilon=3"], "dprun: sigma=2 and target_epsilon=3 both set the noise: target_epsilon "
                                      "calibrates sigma to reach it; give one of them"),
])
def test_command_line_conflicts_are_one_line_before_hydra(tmp_path, args, line):
    """Each was a Hydra traceback or multi-line error (scale=huge: its error formatter itself failed), or, for
    sigma with target_epsilon, a sigma silently replaced by the calibrated one."""
    assert one_line_error(dprun_in_process(*args, "epochs=1", cwd=tmp_path)) == line
    assert not (tmp_path / "outputs").exists()


def test_the_scales_named_are_the_presets_own():
    import yaml
    from runner.overrides import check_scale, experiment_scales
    from runner.paths import CONF_DIR

    scales = list(yaml.safe_load(open(f"{CONF_DIR}/experiment/jl_fig3.yaml").read())["scales"])
    assert experiment_scales("jl_fig3") == scales
    for scale in scales:
        check_scale(["-m", "experiment=jl_fig3", f"scale={scale}"])
    with pytest.raises(DprunError, match="unknown scale 'huge'"):
        check_scale(["-m", "experiment=jl_fig3", "scale=smoke,huge"])  # each value of a sweep


@pytest.mark.parametrize("argv", [["-m", "r=1,4", "method=jl"], ["target_epsilon=null", "sigma=2"],
                                  ["model.widths=[64,32]", "model=mlp"]])
def test_what_the_command_line_checks_let_pass(argv):
    from runner.overrides import check_noise, check_sweeps

    check_sweeps(argv)
    check_noise(argv)


def test_the_edges_of_the_optimizer_and_seed_ranges_pass_the_validator():
    import torch

    from runner.validate import RULES, SEED_RANGE

    for knob, value in [("lr", 3.4028234663852886e38), ("optimizer.eps", 3.4e38), ("seed", SEED_RANGE[0]),
                        ("seed", SEED_RANGE[1])]:
        assert RULES[knob](value) is None, (knob, value)
    for seed in SEED_RANGE:  # what the rule accepts, torch takes
        torch.manual_seed(seed)
        torch.Generator().manual_seed(seed)


def test_a_seed_torch_cannot_take_is_one_line_and_leaves_no_folder(tmp_path):
    proc = dprun_in_process(*TINY, "seed=18446744073709551616", cwd=tmp_path)
    assert one_line_error(proc) == ("dprun: seed=18446744073709551616 is not valid: seed must be an integer in "
                                    "[-9223372036854775808, 18446744073709551615]")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("extra,accepted", [(["optimizer=adam", "optimizer.betas=abc"], "two numbers in [0, 1)"),
                                            (["optimizer=adam", "optimizer.betas=[0.9,1.0]"], "[0, 1)"),
                                            (["optimizer=adam", "optimizer.eps=0"], "> 0"),
                                            (["optimizer=adam", "optimizer.eps=1e39"], "<= 3.4028234663852886e+38")])
def test_adam_knobs_are_refused_before_any_data_is_loaded(tmp_path, no_data, extra, accepted):
    with pytest.raises(DprunError, match=re.escape(accepted)) as err:
        runner.train.train(compose_config(TINY + extra), tmp_path / "run")
    assert "\n" not in str(err.value) and str(err.value).startswith("optimizer.")


@pytest.mark.parametrize("override,valid", [("+method.foo=3", "keep, keep_mb, late, mode, norm"), ("+optimizer.foo=1", "momentum"),
                                            ("+dataset.foo=1", "paper_model")])
def test_an_unknown_option_of_a_group_is_refused_naming_the_valid_ones(tmp_path, no_data, override, valid):
    """Hydra accepts any `+group.key=` into the config; nothing would read it, so the run would ignore it."""
    extra = ["method=reweight"] if override.startswith("+method") else []
    with pytest.raises(DprunError) as err:
        runner.train.train(compose_config(TINY + extra + [override]), tmp_path / "run")
    line = str(err.value)
    assert "\n" not in line and "unknown option" in line and override[1:].split("=")[0] in line and valid in line


def test_every_preset_passes_the_validator():
    """The presets' grids and extra sweeps only set options their groups' configs declare."""
    from conftest import group_options
    from runner.paths import compose
    from runner.validate import validate_config

    for experiment in group_options("experiment"):
        for scale in ("smoke", "paper"):
            base = [f"experiment={experiment}", f"scale={scale}"]
            full = compose(base, return_hydra_config=True)
            grid = {str(k): str(v) for k, v in (full.hydra.sweeper.params or {}).items()}
            for extra in [""] + list(full.get("extra_sweeps") or []):
                sweep = {**grid, **dict(o.split("=", 1) for o in extra.split())}
                validate_config(compose(base + [f"{k}={v.split(',')[0]}" for k, v in sweep.items()]))


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:1"])
def test_every_device_name_passes_the_validator(value):
    from runner.validate import validate_config

    validate_config(compose_config(TINY + [f"device={value}"]))  # CUDA's presence is checked when it is built


@pytest.mark.parametrize("override", ["epochs=0"])  # the one that used to say "finished"
def test_the_command_says_one_line_and_writes_no_metrics(tmp_path, override):
    proc = dprun(*TINY, f"out_dir={tmp_path / 'run'}", override, cwd=tmp_path)
    assert proc.returncode == 2
    assert one_line_error(proc).startswith(f"dprun: {override.split('=')[0]}=")
    assert not list(tmp_path.rglob("metrics.csv"))


def test_jl_at_sample_rate_one_is_refused_before_training(tmp_path):
    # digits has 1437 training examples: batch_size=1437 is q = 1, where the JL analysis has no subsampling
    with pytest.raises(DprunError) as err:
        runner.train.train(compose_config(TINY + ["method=jl", "batch_size=1437"]), tmp_path / "run")
    assert "jl" in str(err.value) and "q=1" in str(err.value) and "batch_size" in str(err.value)
    assert not (tmp_path / "run" / "metrics.csv").exists()


# --- accountant guards: library users get them too


def test_pld_refuses_a_sigma_its_grid_cannot_hold_without_allocating():
    acc = accountants.build("pld")
    with pytest.raises(DprunError, match=r"sigma=0.001.*accountant=rdp"):
        acc.step(accountants.SubsampledGaussian(0.04, 1e-3), count=28)  # used to try to allocate 38 GiB


def test_jl_refuses_sample_rate_one():
    acc = accountants.build("jl")
    with pytest.raises(DprunError, match="q < 1"):
        acc.step(accountants.SubsampledJL(1.0, 1.0, 4), count=28)


@pytest.mark.parametrize("name", ["pld", "rdp", "gdp", "jl"])
def test_no_noise_gives_epsilon_inf_for_every_accountant(name):
    acc = accountants.build(name)
    mech = accountants.SubsampledJL(0.04, 0.0, 4) if name == "jl" else accountants.SubsampledGaussian(0.04, 0.0)
    acc.step(mech, count=28)
    assert acc.epsilon(1e-5) == math.inf


def test_gdp_at_a_tiny_sigma_is_inf_not_an_overflow():
    acc = accountants.build("gdp")
    acc.step(accountants.SubsampledGaussian(0.04, 1e-3), count=28)
    assert acc.epsilon(1e-5) == math.inf


@pytest.mark.parametrize("bad", [dict(sample_rate=1.5, noise_multiplier=1.0), dict(sample_rate=0.1, noise_multiplier=-1),
                                 dict(sample_rate=0.1, noise_multiplier=math.nan)])
def test_a_mechanism_that_is_not_a_probability_or_noise_level_is_refused(bad):
    with pytest.raises(DprunError):
        accountants.SubsampledGaussian(**bad)


# --- Hydra's sweep syntax


@pytest.mark.parametrize("sweep,expected", [("method=choice(nonprivate,reweight)", {"nonprivate", "reweight"}),
                                            ("model=glob(mlp*)", {"mlp"})])
def test_hydra_sweep_functions_run(tmp_path, sweep, expected):
    proc = dprun_in_process("-m", sweep, *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "sweep").rglob("summary.json")]
    key = sweep.split("=")[0]
    assert {s["config"][key]["name"] for s in summaries} == expected
    assert all(s["status"] == "finished" for s in summaries)


@pytest.mark.parametrize("arg,bad", [("method=choice(nonprivate,foo)", "foo"), ("model=glob(zzz*)", "zzz")])
def test_bad_sweep_choices_are_one_line(arg, bad):
    from runner.overrides import check_group_choices

    with pytest.raises(DprunError, match=bad):
        check_group_choices(["-m", arg])


@pytest.mark.parametrize("argv,message", [
    (["method.r=3"], r"^method\.r is not an option of method=nonprivate; its options: name; r belongs to method=jl$"),
    (["method=sbcd", "method.mode=bk"], r"^method\.mode is not an option of method=sbcd; .*mode belongs to "
                                        r"method=reweight$"),
    (["optimizer.betas=[0.9,0.99]"], r"optimizer=sgd; its options: impl, momentum, name, weight_decay; betas belongs "
                                     r"to optimizer=adam$"),
    (["dataset=mnist", "dataset.seq_len=8"], r"^dataset\.seq_len is not an option of dataset=mnist"),
    (["-m", "method=reweight,jl", "method.mode=bk"], r"^method\.mode is not an option of method=jl"),
    (["model.depth=3"], r"^model\.depth needs a named model: model=auto .*depth belongs to model=mlp \(e\.g\. "
                        r"model=mlp model\.depth=3\)$"),  # was Hydra's 6-line "not in struct"
])
def test_a_key_the_chosen_option_lacks_is_one_line(argv, message):
    from runner.overrides import check_group_keys

    with pytest.raises(DprunError, match=message):
        check_group_keys(argv)


@pytest.mark.parametrize("argv", [
    ["method=jl", "method.r=3"], ["dataset=imdb", "optimizer.betas=[0.9,0.99]"],  # imdb's defaults choose adam
    ["method=sbcd", "model.widths=[3]"], ["+method.extra=1"], ["experiment=jl_fig3", "method.anything=1"],
    ["dataset=synthetic", "dataset.train_size=64"], ["model=cnn", "model.hidden=3"],
])
def test_keys_the_chosen_options_have_pass(argv):
    from runner.overrides import check_group_keys

    check_group_keys(argv)


def test_the_command_line_refuses_a_missing_nested_key_in_one_line(tmp_path):
    proc = dprun_in_process("method.mode=twopass", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["dprun: method.mode is not an option of method=nonprivate; its "
                                                "options: name; mode belongs to method=reweight"]


@pytest.mark.parametrize("overrides", [["method=jl"], ["method=reweight", "accountant=gdp"]])
def test_no_noise_runs_and_reports_epsilon_inf(tmp_path, overrides):
    """sigma=0 is allowed (timing the clipping alone) and its epsilon is inf, never a traceback (docs/privacy.md)."""
    summary = runner.train.train(compose_config(TINY + ["sigma=0", *overrides]), tmp_path / "run")
    assert summary["status"] == "finished" and summary["final"]["epsilon"] == math.inf
