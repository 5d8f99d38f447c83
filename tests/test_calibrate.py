"""calibrate_sigma: round trip within 1% for any accountant; impossible targets are one-line errors."""
import pytest

from runner.accountants import ACCOUNTANTS, SubsampledGaussian, SubsampledJL, calibrate_sigma, check_target
from runner.errors import DprunError


class FakeMethod:  # what runner/train.py passes: method.mechanism reads the method's current sigma
    def __init__(self, r=None):
        self.sigma, self.r = 1.0, r

    def mechanism(self, q):
        if self.r is None:
            return SubsampledGaussian(q, self.sigma)
        return SubsampledJL(q, self.sigma, self.r)


def epsilon(name, mech, steps, delta=1e-5):
    acc = ACCOUNTANTS.build(name)
    acc.step(mech, count=steps)
    return acc.epsilon(delta)


@pytest.mark.parametrize("name", ["rdp", "pld", "gdp"])
def test_round_trip(name):
    q, steps, target = 0.02, 200, 0.5  # sigma > 1: cheap PLDs
    sigma = calibrate_sigma(name, FakeMethod().mechanism, q, steps, target, 1e-5)
    assert 0.99 * target <= epsilon(name, SubsampledGaussian(q, sigma), steps) <= target


@pytest.mark.slow
def test_round_trip_jl():
    q, steps, target = 0.01, 50, 1.0
    sigma = calibrate_sigma("jl", FakeMethod(r=200).mechanism, q, steps, target, 1e-5)
    assert 0.99 * target <= epsilon("jl", SubsampledJL(q, sigma, 200), steps) <= target


def test_impossible_target_is_one_line():
    with pytest.raises(DprunError, match="target_epsilon=0.0001 is unreachable") as err:
        calibrate_sigma("rdp", FakeMethod().mechanism, 0.5, 10_000, 1e-4, 1e-5)
    assert "\n" not in str(err.value) and "epsilon=" in str(err.value)


def test_a_target_only_sigmas_near_the_largest_meet_is_met():
    """sigma grows 1, 4, ..., 256, then 1024 > SIGMA_MAX: it gave up without trying SIGMA_MAX = 1000 itself, so a
    target that sigma ~600 meets (rdp: 0.2288 at 500, 0.1086 at 1000; q = 1, 1000 steps) was called unreachable."""
    sigma = calibrate_sigma("rdp", FakeMethod().mechanism, 1.0, 1000, 0.2, 1e-5)
    assert 500 < sigma <= 1000 and 0.99 * 0.2 <= epsilon("rdp", SubsampledGaussian(1.0, sigma), 1000) <= 0.2
    assert calibrate_sigma("rdp", FakeMethod().mechanism, 1.0, 1000, 0.1087, 1e-5) == pytest.approx(1000, rel=2e-3)


def test_an_unreachable_jl_target_names_r():
    """JL(1)'s estimates have a heavy tail that no sigma removes: the one line says a larger r is the way out."""
    with pytest.raises(DprunError, match="unreachable with accountant=jl.*no finite epsilon.*a larger r") as err:
        calibrate_sigma("jl", FakeMethod(r=1).mechanism, 0.04, 4, 3.0, 1e-5)
    assert "\n" not in str(err.value) and "now 1" in str(err.value)


def test_check_target_warns_when_a_gdp_sigma_misses_the_certified_target(caplog):
    q, steps, target = 0.02, 200, 2.0
    method = FakeMethod()
    method.sigma = calibrate_sigma("gdp", method.mechanism, q, steps, target, 1e-5)  # the CLT: can underestimate
    facts = check_target("pld", "gdp", method.mechanism(q), steps, target, 1e-5)
    published = epsilon("pld", method.mechanism(q), steps)
    assert facts == {"calibration_accountant": "gdp", "planned_epsilon": pytest.approx(published),
                     "target_epsilon_met": False} and published > target
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "target_epsilon=2 is not met" in warning.getMessage() and f"{published:.4g}" in warning.getMessage()


@pytest.mark.parametrize("publisher", ["pld", "gdp"])  # gdp publishes PLD's certified epsilon
def test_check_target_with_a_certified_calibrator_meets_it_quietly(caplog, publisher):
    q, steps, target = 0.02, 200, 2.0
    method = FakeMethod()
    method.sigma = calibrate_sigma("pld", method.mechanism, q, steps, target, 1e-5)
    facts = check_target(publisher, "pld", method.mechanism(q), steps, target, 1e-5)
    assert facts["target_epsilon_met"] is True and 0.99 * target <= facts["planned_epsilon"] <= target
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_accountant_none_calibrates_with_pld(tmp_path):
    """accountant=none publishes no epsilon, but target_epsilon still calibrates sigma (with pld, as
    calibration_accountant's docstring says); it used to stop with "unknown accountant 'none'"."""
    import json

    from conftest import dprun_in_process
    from runner.accountants import calibration_accountant

    assert calibration_accountant("none") == "pld"
    proc = dprun_in_process("method=reweight", "dataset=digits", "epochs=1", "max_steps_per_epoch=2",
                            "progress=false", "accountant=none", "target_epsilon=2", f"out_dir={tmp_path}/run",
                            cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["calibration_accountant"] == "pld" and summary["target_epsilon_met"] is True


def test_a_calibrator_that_cannot_analyse_the_mechanism_names_one_that_can():
    with pytest.raises(DprunError, match=r"accountant=pld cannot calibrate sigma for mechanism SubsampledJL; set "
                                         r"calibration_accountant=jl") as err:
        calibrate_sigma("pld", FakeMethod(r=4).mechanism, 0.04, 10, 2.0, 1e-5)
    assert "\n" not in str(err.value)


def test_a_composition_too_large_to_hold_is_one_line_before_allocating():
    """dprun method=reweight epochs=1e9 target_epsilon=1 (digits: 2.2e10 steps) tried to allocate 769 GiB in the PLD
    composition; now one line before any FFT, pointing to rdp (no grid) or fewer epochs."""
    import time

    start = time.perf_counter()
    with pytest.raises(DprunError, match=r"accountant=pld cannot compose 22000000000 steps .* use accountant=rdp "
                                         r"\(no grid\) or fewer epochs") as err:
        calibrate_sigma("pld", FakeMethod().mechanism, 64 / 1437, 22 * 10 ** 9, 1.0, 1e-5)
    assert "\n" not in str(err.value) and time.perf_counter() - start < 30
    acc = ACCOUNTANTS.build("pld")  # the plain accounting of such a run: the same guard
    acc.step(SubsampledGaussian(64 / 1437, 1.0), count=22 * 10 ** 9)
    with pytest.raises(DprunError, match="cannot compose"):
        acc.epsilon(1e-5)


def test_calibration_stops_shrinking_sigma_where_the_composition_gets_too_large(monkeypatch):
    """A loose target lets sigma shrink toward SIGMA_MIN, whose PLDs grow like 1/sigma^2: where one is too large to
    compose, the last sigma that met the target is used."""
    import runner.accountants.pld as pld

    monkeypatch.setattr(pld, "MAX_COMPOSED_POINTS", 2e6)
    sigma = calibrate_sigma("pld", FakeMethod().mechanism, 0.02, 200, 50.0, 1e-5)
    assert sigma >= 0.05 and epsilon("pld", SubsampledGaussian(0.02, sigma), 200) <= 50.0
