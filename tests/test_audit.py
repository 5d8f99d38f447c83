"""The one-run privacy audit (runner/audit/, docs/audit.md): the bounds against worked numbers, and audits of real
private steps that must stay at or below the claimed epsilon, while non-private, noiseless and broken runs are
caught (an audited lower bound far above a private run's)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from runner import accountants
from runner.accountants.mechanisms import SubsampledGaussian
from runner.audit import bounds
from runner.audit.run import attach, begin
from runner.audit.scoring import audit_scores
from runner.data.base import DataInfo
from runner.errors import DprunError
from runner.methods import METHODS
from runner.validate import validate_config
from conftest import compose_config

BETA, DELTA = 0.05, 1e-5


# -- the bounds ------------------------------------------------------------------------------------------------------
def test_perfect_guesses_at_delta_zero_match_the_closed_form():
    """Steinke et al., Theorem 3.1 at delta = 0: P[all r correct] = q^r with q = e^eps / (1 + e^eps), so the bound
    is logit(beta^(1/r)); r = 100, beta = 0.05 gives 3.493."""
    for r in (10, 100, 1000):
        q = BETA ** (1 / r)
        assert bounds.epsilon_lower_bound(1000, r, r, BETA, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)
    assert bounds.epsilon_lower_bound(1000, 100, 100, BETA, 0.0) == pytest.approx(3.493, abs=1e-3)


def test_p_value_is_the_binomial_tail_plus_the_delta_term():
    """Algorithm 2 of Steinke et al.: P[Bin(r, q) >= v] + 2 m delta max_i P[v > Bin >= v - i] / i."""
    from scipy import stats
    m, r, v, eps = 1000, 200, 150, 1.0
    q = 1 / (1 + math.exp(-eps))
    tail = stats.binom.sf(v - 1, r, q)
    assert bounds.p_value(m, r, v, eps, 0.0) == pytest.approx(tail)
    alpha = max((stats.binom.sf(v - i - 1, r, q) - tail) / i for i in range(1, v + 1))
    assert bounds.p_value(m, r, v, eps, 1e-3) == pytest.approx(tail + 2 * m * 1e-3 * alpha)
    # delta > 0 only weakens the bound; chance-level guessing bounds nothing
    assert bounds.epsilon_lower_bound(m, r, v, BETA, DELTA) <= bounds.epsilon_lower_bound(m, r, v, BETA, 0.0)
    assert bounds.epsilon_lower_bound(m, 500, 250, BETA, DELTA) == 0.0


def test_gaussian_dp_conversion_is_the_analytic_gaussian_mechanism():
    """mu-GDP's epsilon at delta = the epsilon of the Gaussian mechanism with sigma = 1 / mu (dp-accounting)."""
    import dp_accounting
    for mu in (0.5, 1.0, 2.0):
        eps = bounds.gdp_epsilon(mu, DELTA)
        assert dp_accounting.get_sigma_gaussian(eps, DELTA) == pytest.approx(1 / mu, rel=1e-4)


def test_fdp_analysis_is_tighter_and_sound_on_a_gaussian_mechanism():
    """Scores of an exact mu-GDP mechanism (in: shifted by mu = 1): every number stays below its epsilon, the
    Gaussian-DP one (valid here: the curve is Gaussian) is the tightest (Mahloujifar et al.), and none exceeds its
    ceiling; the two lower bounds of an (eps, delta) claim are close to each other."""
    rng = np.random.default_rng(0)
    inc = rng.random(1000) < 0.5
    result = audit_scores(rng.normal(size=1000) + 1.0 * inc, inc, beta=BETA, delta=DELTA)
    lower = max(result.epsilon_lower_bound, result.epsilon_lower_bound_fdp)
    assert 0 < lower < result.epsilon_gdp <= bounds.gdp_epsilon(1.0, DELTA)
    assert result.epsilon_lower_bound_fdp == pytest.approx(result.epsilon_lower_bound, abs=0.1)
    assert result.mu_lower_bound <= 1.0
    assert result.epsilon_lower_bound <= result.ceiling and result.epsilon_lower_bound_fdp <= result.ceiling_fdp
    assert result.epsilon_gdp <= result.ceiling_gdp
    assert not result.rejects(bounds.gdp_epsilon(1.0, DELTA))  # its true epsilon is not refuted


def test_guesses_are_chosen_on_one_half_and_bounded_on_the_other():
    """k+ and k- are chosen from the selection half's labels only: flipping every label of the bound half changes
    the counts but never the number of guesses; the bound is the bound half's (m/2 canaries)."""
    rng = np.random.default_rng(1)
    inc = rng.random(400) < 0.5
    scores = inc + rng.normal(size=400)
    result = audit_scores(scores, inc, beta=BETA, delta=DELTA, seed=3)
    held = np.random.default_rng(3).permutation(400)[200:]
    flipped = inc.copy()
    flipped[held] = ~flipped[held]
    other = audit_scores(scores, flipped, beta=BETA, delta=DELTA, seed=3)
    assert result.scored == other.scored == 200
    assert other.guesses == result.guesses and other.correct == result.guesses - result.correct
    assert result.epsilon_lower_bound == bounds.epsilon_lower_bound(200, result.guesses, result.correct, BETA, DELTA)


# -- the verdict: false alarms and power on mechanisms of known epsilon ------------------------------------------------
def randomized_response(eps: float, seed: int, m: int = 1000):
    """(scores, included) of m canaries released by eps-randomized response: each canary's bit, flipped with
    probability 1 / (1 + e^eps). Exactly (eps, 0)-DP per canary, so (eps, delta)-DP for every delta; its tradeoff
    curve is the (eps, 0) one, not a Gaussian's."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    keep = rng.random(m) < 1 / (1 + math.exp(-eps))
    return np.where(keep, included, ~included).astype(float), included


def audit_verdict(scores, included, claimed: float, seed: int) -> dict:
    """runner/audit/run.py's report on these scores, as a run that claims (claimed, DELTA)-DP: summary['audit']."""
    from runner.audit.run import report
    audit = SimpleNamespace(kind="gradient", canaries=len(scores), confidence=1 - BETA, seed=seed,
                            included=torch.as_tensor(included), scores=lambda model: scores)
    run = SimpleNamespace(cfg=SimpleNamespace(delta=DELTA), method=SimpleNamespace(private=True),
                          rows=[{"epsilon": claimed}], summary={}, model=None)
    report(run, audit)
    return run.summary["audit"]


RR_SEEDS = range(8)  # fixed: each was flagged by the old criterion (the Gaussian-DP number above the claim)


def test_an_exactly_private_mechanism_is_not_flagged_more_often_than_two_beta():
    """Randomized response at eps = 2, m = 1000, audited against its true claim (2, 1e-5): the audit's flag may fire
    with probability <= 2 beta per run (Steinke et al.'s test and Mahloujifar et al.'s test of the claimed tradeoff,
    each <= beta). 8 fixed seeds: more than binom.ppf(0.99, 8, 2 beta) = 3 flags would be a < 1% event. The old flag
    (the Gaussian-DP epsilon above the claim: mu-GDP refuted, not (eps, delta)-DP) fired on all 8."""
    from scipy import stats
    flags = [audit_verdict(*randomized_response(2.0, seed), claimed=2.0, seed=seed)["above_claimed"]
             for seed in RR_SEEDS]
    assert sum(flags) <= stats.binom.ppf(0.99, len(flags), 2 * BETA), flags


def test_a_mechanism_clearly_worse_than_its_claim_is_flagged(caplog):
    """Randomized response at eps = 4 claiming eps = 2: the claim is false, and every seed refutes it."""
    caplog.set_level("WARNING", logger="dprun")
    for seed in range(4):
        verdict = audit_verdict(*randomized_response(4.0, seed), claimed=2.0, seed=seed)
        assert verdict["above_claimed"] is True
        assert max(verdict["epsilon_lower_bound"], verdict["epsilon_lower_bound_fdp"]) > 2.0
    assert sum("PRIVACY AUDIT FAILED" in r.message for r in caplog.records) == 4


def test_the_tradeoff_test_is_a_test_of_the_claim():
    """Mahloujifar et al.'s recursion on the (eps, delta)-DP tradeoff: a weaker claim is rejected less (monotone in
    eps), its bound is the boundary, and on perfect guesses it sits with Steinke et al.'s (both near logit(beta^(1/r))
    at delta ~ 0), far below the Gaussian-DP number of the same counts (which assumes a Gaussian-shaped curve)."""
    m, r, v = 500, 100, 83
    eps = bounds.epsilon_lower_bound_tradeoff(m, r, v, BETA, DELTA)
    assert bounds.epsdp_rejects(eps - 1e-3, DELTA, m, r, v, BETA) and not bounds.epsdp_rejects(eps + 1e-3, DELTA, m, r,
                                                                                             v, BETA)
    assert [bounds.epsdp_rejects(e, DELTA, m, r, v, BETA) for e in (0.0, 0.5, 1.0, 1.5, 3.0)] == \
        [True, True, True, False, False]
    for r in (25, 100, 500):
        assert bounds.epsilon_lower_bound_tradeoff(m, r, r, BETA, DELTA) == \
            pytest.approx(bounds.epsilon_lower_bound(m, r, r, BETA, DELTA), abs=0.05)
        assert bounds.epsilon_gdp(m, r, r, BETA, DELTA) > 1.4 * bounds.epsilon_lower_bound(m, r, r, BETA, DELTA)


# -- audits of real steps --------------------------------------------------------------------------------------------
class NoClipReweight(METHODS.get("reweight")):
    """A broken method: per-example gradients summed unclipped (the clip factors are all 1)."""

    def clip_factors(self, norms):
        return torch.ones_like(norms)


class NoNoiseReweight(METHODS.get("reweight")):
    """A broken method: clipped, but the noise is never added (sigma is still told to the accountant)."""

    def update(self, model, optimizer, mechanism, **_):
        from runner.methods.base import trainable
        for p in trainable(model):
            p.grad /= 64.0
        optimizer.step()


def audited(method, *, kind="gradient", m=200, steps=60, physical=None, seed=0, x_scale=None, lr=0.5,
            score="steps"):
    """A tiny private run (linear model, 256 random examples, q = 1/4) with audit=one_run: (result, claimed, audit).
    Gradient canaries: small inputs (x_scale 0.01), so that the real examples' weight gradients, which no clipping
    bounds in a non-private run, do not drown the canaries' C u_j (a data set's unused inputs do the same)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x_scale = x_scale if x_scale is not None else (0.01 if kind == "gradient" else 1.0)
    x, y = x_scale * torch.randn(256, 100, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    data = SimpleNamespace(train_x=x, train_y=y, info=DataInfo("random", (100,), 4, train_size=256))
    cfg = OmegaConf.create({"seed": seed, "lr": lr, "batch_size": 64, "audit": {
        "name": "one_run", "canaries": m, "canary": kind, "confidence": 0.95, "direction": "dirac", "score": score}})
    audit = begin(cfg, data)
    model = method.configure(physical_batch_size=physical).attach(torch.nn.Linear(100, 4))
    n, batch = len(data.train_y), 64
    q = batch / n
    attach(audit, method, model, q)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = (torch.rand(n, generator=gen) < q).nonzero().squeeze(1)
        method.step(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), data.train_x[idx],
                    data.train_y[idx], opt, sample_rate=q, expected_batch_size=batch, generator=gen)
    result = audit_scores(audit.scores(model), audit.included.numpy(), beta=BETA, delta=DELTA, seed=audit.seed)
    claimed = math.inf
    if method.private and method.sigma > 0:
        acc = accountants.build("pld")
        acc.step(SubsampledGaussian(sample_rate=q, noise_multiplier=method.sigma), count=steps)
        claimed = acc.epsilon(DELTA)
    return result, claimed, audit


def build(name, sigma=1.0, cls=None):
    return (cls or METHODS.get(name))(clip=1.0, sigma=sigma)


def test_private_runs_audit_below_their_claim_and_controls_far_above():
    found = lambda r: max(r.epsilon_lower_bound, r.epsilon_lower_bound_fdp)  # noqa: E731
    private, claimed, audit = audited(build("reweight", sigma=3.0))
    assert audit.gradient.drawn > 0  # the canaries did join the steps
    assert found(private) <= claimed and not private.rejects(claimed)
    for control in (build("nonprivate"), build("reweight", sigma=0.0)):  # no privacy; clipping without noise
        result, _, _ = audited(control)
        # 200 canaries: the lower bounds' ceiling is 3.49 (Steinke et al., m' = 100); the controls reach ~1.7
        assert found(result) > found(private) + 1.0
        assert result.epsilon_gdp > private.epsilon_gdp + 2.0


def test_a_method_that_adds_no_noise_is_caught():
    """Clipped, never noised, while the accountant is told sigma = 8: the claim (< 1) is refuted by the sound tests
    (Steinke et al.'s and the f-DP test of the claimed (eps, delta) curve), not only by the Gaussian-DP number."""
    result, claimed, _ = audited(build("reweight", sigma=8.0, cls=NoNoiseReweight))
    assert claimed < 1.0  # what the (wrong) method claims
    assert result.rejects(claimed)  # the audit proves the claim false
    assert min(result.epsilon_lower_bound, result.epsilon_lower_bound_fdp) > claimed


def test_a_method_that_skips_clipping_is_caught_by_input_canaries():
    """Mislabelled random inputs have gradients far above C: unclipped, they stand out of the noise. The sound tests
    need a small claim to refute (sigma = 8: 0.655) and a large step (lr 0.2); at sigma = 4 (claim 1.455, lr 0.05)
    the broken run audits 0.95 and is not caught (only its Gaussian-DP number, 1.86, exceeds the claim)."""
    honest, claimed, _ = audited(build("reweight", sigma=8.0), kind="input", lr=0.2)
    broken, _, _ = audited(build("reweight", sigma=8.0, cls=NoClipReweight), kind="input", lr=0.2)
    assert honest.epsilon_lower_bound <= claimed and not honest.rejects(claimed)
    assert broken.rejects(claimed)
    assert max(broken.epsilon_lower_bound, broken.epsilon_lower_bound_fdp) > claimed


def test_physical_batches_audit_as_one_pass():
    """Chunks only add clipped sums: the canaries' scores, and so the audit, are the one-pass run's (score=sum
    here; the other tests use the default per-step score)."""
    one, _, a1 = audited(build("reweight", sigma=1.0), steps=20, score="sum")
    chunked, _, a2 = audited(build("reweight", sigma=1.0), steps=20, physical=16, score="sum")
    np.testing.assert_allclose(a1.gradient.scores(), a2.gradient.scores(), rtol=1e-4, atol=1e-6)
    assert (one.guesses, one.correct) == (chunked.guesses, chunked.correct)


def test_gradient_canaries_refuse_a_method_without_a_gradient_sum():
    method = SimpleNamespace(updates_model=True, name="sbcd")
    audit = SimpleNamespace(kind="gradient")
    with pytest.raises(DprunError, match="audit.canary=input"):
        attach(audit, method, torch.nn.Linear(2, 2), 0.1)


@pytest.mark.parametrize("override, accepted", [("audit.canary=foo", "gradient, input, adversarial"),
                                                ("audit.canaries=1", "an integer >= 2"),
                                                ("audit.confidence=1.5", "(0.5, 1)"),
                                                ("audit.confidence=0.3", "(0.5, 1)"),  # review 63
                                                ("audit.confidence=0.5", "(0.5, 1)"),
                                                ("audit.direction=x", "dirac, random")])
def test_bad_audit_values_get_one_line(override, accepted):
    with pytest.raises(DprunError) as e:
        validate_config(compose_config(["audit=one_run", override]))
    assert accepted in str(e.value) and "\n" not in str(e.value)


# -- the CLI's run ---------------------------------------------------------------------------------------------------
def run_audited(tmp_path, *overrides):
    from runner.train import train
    cfg = compose_config(["device=cpu", "progress=false", "epochs=2", "audit=one_run", "audit.canaries=200",
                          "checkpoint=false", *overrides])
    return train(cfg, tmp_path / "run")


def test_summary_has_the_audit_and_input_canaries_grow_the_training_set(tmp_path, caplog):
    caplog.set_level("INFO", logger="dprun")
    summary = run_audited(tmp_path, "method=reweight", "sigma=2", "audit.canary=input", "dtype=float64")
    audit = summary["audit"]
    assert {"kind", "canaries", "guesses", "correct", "epsilon_lower_bound", "epsilon_lower_bound_fdp", "ceiling",
            "confidence", "epsilon_claimed"} <= set(audit)
    assert audit["kind"] == "input" and audit["canaries"] == 200 and audit["confidence"] == 0.95
    assert audit["epsilon_claimed"] == summary["final"]["epsilon"] and not audit["above_claimed"]
    assert audit["can_refute"] is (audit["epsilon_claimed"] < max(audit["ceiling"], audit["ceiling_fdp"]))
    n_in = int(begin(compose_config(["audit=one_run", "audit.canaries=200"]),
                     SimpleNamespace(train_x=torch.zeros(1), train_y=torch.zeros(1))).included.sum())
    assert summary["sample_rate"] == pytest.approx(64 / (1437 + n_in))  # q = B / N with the canaries in N
    assert any("claimed epsilon=" in r.message and "audited epsilon >=" in r.message for r in caplog.records)


def test_a_run_without_noise_fails_its_audit_loudly(tmp_path, caplog, monkeypatch):
    """The whole CLI path: a method whose noise went missing (sigma still told to the accountant) is flagged."""
    import runner.methods.base as base
    real = base.add_noise_and_scale
    monkeypatch.setattr(base, "add_noise_and_scale", lambda model, std, b, gen=None, params=None: real(model, 0.0, b, gen, params))
    summary = run_audited(tmp_path, "method=reweight", "sigma=4", "epochs=4")
    assert summary["audit"]["above_claimed"] is True
    assert any("PRIVACY AUDIT FAILED" in r.message for r in caplog.records)


def test_a_claim_above_the_ceiling_is_said_to_be_beyond_the_audit(tmp_path, caplog, monkeypatch):
    """Review 26: m canaries cannot certify more than their ceiling, so a claim above it passes even without noise;
    the run says so (a WARNING, summary.json can_refute false) instead of a silent pass."""
    import runner.methods.base as base
    real = base.add_noise_and_scale
    monkeypatch.setattr(base, "add_noise_and_scale", lambda model, std, b, gen=None, params=None: real(model, 0.0, b, gen, params))
    summary = run_audited(tmp_path, "method=reweight", "sigma=0.3", "epochs=2")
    audit = summary["audit"]
    assert audit["epsilon_claimed"] > audit["ceiling"] and audit["can_refute"] is False
    assert not audit["above_claimed"]
    assert any("this audit cannot refute it" in r.message for r in caplog.records)



def test_two_ranks_audit_as_one_process(tmp_path):
    """Every rank draws the canaries' Poisson draws, rank 0 adds them before the all-reduce: the 2-process run's
    audit is the one-process run's (scores equal in float64, so the guesses, counts and bounds too). Small: two
    spawned processes, 4 steps, 200 canaries (~15 s)."""
    from runner.train import train
    from test_distributed import _train_worker, spawn

    base = ["method=reweight", "dtype=float64", "progress=false", "max_steps_per_epoch=4", "batch_size=32",
            "epochs=1", "audit=one_run", "audit.canaries=200", "checkpoint=false"]
    one = train(compose_config(base), tmp_path / "one")["audit"]
    spawn(_train_worker, 2, tmp_path / "work", base, tmp_path / "two")
    two = __import__("json").loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2
    assert one["guesses"] > 0
    for key in ("guesses", "correct", "epsilon_lower_bound", "epsilon_lower_bound_fdp", "epsilon_claimed"):
        assert two["audit"][key] == pytest.approx(one[key], rel=1e-9), key


def test_report_shows_the_audited_column_and_flags_a_failed_audit():
    from runner.audit.columns import audit_columns, audited_text
    row = audit_columns({"audit": {"kind": "gradient", "epsilon_lower_bound": 0.32, "epsilon_lower_bound_fdp": 0.39,
                                   "ceiling": 5.1, "above_claimed": False}})
    assert audited_text(row["audited_epsilon"], row["audited_epsilon_fdp"], row["audit_above_claimed"]) == \
        ">= 0.32 (f-DP 0.39)"
    assert audited_text(9.1, 9.5, True).startswith("AUDIT FAILED")
    assert audited_text(*[audit_columns({})[k] for k in ("audited_epsilon", "audited_epsilon_fdp",
                                                          "audit_above_claimed")]) == ""


def test_input_canaries_do_not_depend_on_the_training_records():
    """They were drawn over the training set's own min and max: one record setting the max moved every canary (with
    m canaries up to m C). A loader's fixed normalisation gives the public range instead."""
    from runner.audit.canaries import input_canaries
    from runner.data.base import Dataset, normalised_range

    info = DataInfo("mnist", (1, 4, 4), 10, input_range=normalised_range(0.1307, 0.3081))
    x = torch.rand(50, 1, 4, 4) * 0.5
    outlier = x.clone()
    outlier[0] = 5.0  # one record beyond the others
    y = torch.randint(0, 10, (50,))
    for kind in ("input", "adversarial"):
        a, _ = input_canaries(kind, 16, Dataset(info, x, y, x[:0], y[:0]), seed=0)
        b, _ = input_canaries(kind, 16, Dataset(info, outlier, y, x[:0], y[:0]), seed=0)
        assert torch.equal(a, b)
        lo, hi = info.input_range
        assert lo == pytest.approx(-0.1307 / 0.3081) and hi == pytest.approx(0.8693 / 0.3081)
        assert a.min() >= lo and a.max() <= hi


def test_audited_bounds_are_shown_rounded_down(caplog, monkeypatch):
    """Review 36: the log line and dprun-report's column showed the audited lower bounds rounded to nearest
    (%.3f / .3g: 0.8646 as ">= 0.865", above itself); a lower bound is shown rounded down, like epsilon_lower_bound."""
    from types import SimpleNamespace

    import runner.audit.run as audit_run
    from runner.audit.columns import audited_text

    assert audited_text(0.8646, 0.8999, False) == ">= 0.864 (f-DP 0.899)"
    result = SimpleNamespace(epsilon_lower_bound=0.8646, epsilon_lower_bound_fdp=0.91251, ceiling=4.3339,
                             ceiling_fdp=4.0, correct=7, guesses=8, scored=100, epsilon_gdp=1.0, mu_lower_bound=0.5,
                             ceiling_gdp=3.0, guesses_fdp=8, correct_fdp=7, rejects=lambda claimed: True)
    monkeypatch.setattr(audit_run, "audit_scores", lambda *a, **k: result)
    audit = SimpleNamespace(confidence=0.95, kind="input", canaries=200, seed=0, scores=lambda model: None,
                            included=torch.zeros(3))
    run = SimpleNamespace(cfg=SimpleNamespace(delta=1e-5), model=None, summary={},
                          method=SimpleNamespace(private=True), rows=[{"epsilon": 0.5}])
    caplog.set_level("INFO", logger="dprun")
    audit_run.report(run, audit)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "audited epsilon >= 0.864 (f-DP: >= 0.912" in text and "ceiling 4.33)" in text
    assert "the audited lower bound 0.912 is above" in text


def test_a_secure_runs_audit_draws_are_not_replayable_from_seed(monkeypatch):
    """Review 40: under rng=secure the audit's draws (which canaries join, their Poisson draws and directions) came
    from seed + 7919, so anyone holding summary.json's seed predicted them. Now a secret seed under secure; a seeded
    run keeps seed + 7919 (replayable, as everything else in it)."""
    import runner.audit.run as audit_run
    from runner.train import load_data

    seen = {}
    real = audit_run.begin

    def begin(cfg, data, secret_seed=None):
        audit = real(cfg, data, secret_seed)
        seen.setdefault(str(cfg.rng), []).append((audit.seed, audit.included.clone()))
        return audit

    monkeypatch.setattr(audit_run, "begin", begin)
    for rng in ("seeded", "secure"):
        for _ in range(2):
            load_data(compose_config(["audit=one_run", "audit.canaries=200", f"rng={rng}", "seed=5"]),
                      torch.device("cpu"), torch.float32)
    (s0, inc0), (s1, inc1) = seen["seeded"]
    assert s0 == s1 == 5 + 7919 and torch.equal(inc0, inc1)
    (t0, jnc0), (t1, jnc1) = seen["secure"]
    assert t0 != t1 and 5 + 7919 not in (t0, t1) and not torch.equal(jnc0, jnc1)


def test_the_audits_draws_depend_on_every_bit_of_its_seed():
    """Review 41: the audit's generators were torch.Generator().manual_seed(seed + k), which keeps 32 bits on the CPU,
    so its secret seed under rng=secure made each one of 2^32 streams. Seeds 2^32 apart now draw apart."""
    from runner.audit.canaries import inclusion, input_canaries

    seed = 123_456_789_012
    assert not torch.equal(inclusion(200, seed), inclusion(200, seed + 2**32))
    assert torch.equal(inclusion(200, seed), inclusion(200, seed))  # a seed still replays its own draws
    data = SimpleNamespace(train_x=torch.rand(50, 6), train_y=torch.randint(0, 3, (50,)),
                           info=DataInfo("random", (6,), 3, train_size=50))
    a, b = input_canaries("input", 20, data, seed), input_canaries("input", 20, data, seed + 2**32)
    assert not torch.equal(a[0], b[0])
