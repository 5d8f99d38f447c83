"""`dprun audit=one_run`: the audit inside a training run, three calls from runner/train.py.

    audit = begin(cfg, data)                        after the data is loaded: input canaries join the training set
    attach(audit, method, model, sampler.sample_rate)  after method.attach: gradient canaries join the clipped sum
    finish(run)                                     before summary.json's last write: score, bound, report

summary.json gains "audit": {kind, canaries, guesses, correct, epsilon_lower_bound, epsilon_lower_bound_fdp,
epsilon_gdp, ceiling, confidence, epsilon_claimed, above_claimed, ...}; the log states claimed vs audited, and a
refuted claim (Steinke et al.'s or Mahloujifar et al.'s test of the claimed (eps, delta) rejects it) is a WARNING:
a run that has its claimed privacy is flagged with probability <= 2 beta, so it means a privacy bug, never a result.
The Gaussian-DP number (epsilon_gdp) assumes a Gaussian-shaped privacy curve and never flags.
"""
from __future__ import annotations

import logging
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from runner.epsilon_shown import shown_epsilon, shown_lower_bound
from runner.audit.canaries import GradientCanaries, inclusion, input_canaries
from runner.audit.scoring import audit_scores
from runner.errors import DprunError

log = logging.getLogger("dprun")

KINDS = ("gradient", "input", "adversarial")
DIRECTIONS = ("dirac", "random")


@dataclass
class Audit:
    kind: str
    canaries: int
    confidence: float
    seed: int
    included: torch.Tensor  # (m,) bool
    direction: str = "dirac"  # gradient canaries: dirac | random
    score: str = "steps"  # gradient canaries: steps (every iterate) | sum (theta_T - theta_0)
    step_size: float = 1.0  # lr / B: a canary's move per unit of gradient in one SGD step
    canary_x: torch.Tensor | None = None  # input kinds: all m canaries, in and out
    canary_y: torch.Tensor | None = None
    gradient: GradientCanaries | None = None

    def add_canaries(self, params: list[torch.Tensor]) -> None:
        """Method.clipped_sum's hook: this step's gradient canaries (nothing for input canaries)."""
        if self.gradient is not None:
            self.gradient.add_(params)

    def scores(self, model: torch.nn.Module, batch: int = 1024) -> np.ndarray:
        """(m,) higher = more likely in: the parameter change along each direction, or minus the final loss."""
        if self.gradient is not None:
            return self.gradient.scores()
        was_training = model.training
        model.eval()
        x = self.canary_x  # dtype=float64 converts the training set after the canaries joined it: follow the model
        if x.is_floating_point():
            x = x.to(next(model.parameters()).dtype)
        with torch.no_grad():
            losses = [F.cross_entropy(model(x[i:i + batch]).float(), self.canary_y[i:i + batch],
                                      reduction="none") for i in range(0, self.canaries, batch)]
        model.train(was_training)
        return (-torch.cat(losses)).double().cpu().numpy()


def begin(cfg, data, secret_seed: int | None = None) -> Audit | None:
    """The run's audit from cfg.audit (None for audit=none); input canaries that are in join data's training set.
    secret_seed (rng=secure): the audit's draws from it, not from the run's public seed (never written: summary.json's
    "audit" holds no seed)."""
    spec = cfg.get("audit")
    if spec is None or str(spec.get("name", "none")) == "none":
        return None
    if cfg.get("resume"):
        raise DprunError("audit=one_run cannot resume a run: the canaries' draws are not checkpointed; start afresh")
    kind, m = str(spec.canary), int(spec.canaries)
    seed = int(cfg.seed) + 7919 if secret_seed is None else int(secret_seed) % 2**62  # apart from the run's streams
    audit = Audit(kind, m, float(spec.confidence), seed, inclusion(m, seed), str(spec.get("direction", "dirac")),
                  str(spec.get("score", "steps")), float(cfg.get("lr", 1.0)) / float(cfg.get("batch_size", 1)))
    if kind != "gradient":
        audit.canary_x, audit.canary_y = input_canaries(kind, m, data, seed)
        keep = audit.included.to(audit.canary_x.device)
        data.train_x = torch.cat([data.train_x, audit.canary_x[keep]])
        data.train_y = torch.cat([data.train_y, audit.canary_y[keep]])
        # N grows: the sampler's q and the accountant's epsilon are for the dataset that contains them
        data.info = dataclasses.replace(data.info, train_size=len(data.train_y))
    return audit


def attach(audit: Audit | None, method, model: torch.nn.Module, sample_rate: float) -> None:
    """Give the method the audit's hook; gradient canaries get the model's trainable parameters and the rate q."""
    if audit is None:
        return
    method.audit = audit
    if audit.kind == "gradient":
        if method.updates_model:
            raise DprunError(f"audit.canary=gradient needs a clipped gradient sum, and method={method.name}'s step "
                             f"is not one (its block updates set the weights); use audit.canary=input or adversarial")
        params = [p for p in model.parameters() if p.requires_grad]
        audit.gradient = GradientCanaries(params, audit.canaries, method.clip, sample_rate, audit.seed,
                                          audit.direction, method.world.main, audit.score,
                                          audit.step_size * method.clip)


def claimed_epsilon(run) -> float | None:
    """The run's published epsilon: inf for a non-private run or sigma = 0, None where none is certified."""
    if not run.method.private:
        return math.inf
    value = run.rows[-1].get("epsilon") if run.rows else None
    return None if value in ("", None) else float(value)


def finish(run) -> None:
    """Score the canaries, bound epsilon, write summary['audit'] and the claimed-vs-audited line (rank 0). An error
    here is recorded in summary['audit'] and logged, never raised: summary.json's final write must still happen."""
    audit = getattr(run.method, "audit", None)
    if audit is None or run.summary.get("status") != "finished" or not run.world.main:
        return
    try:
        report(run, audit)
    except Exception as e:  # noqa: BLE001
        run.summary["audit"] = {"kind": audit.kind, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        log.error("audit failed to score: %s", run.summary["audit"]["error"])


def report(run, audit: Audit) -> None:
    """The audit's numbers into summary['audit'], the claimed-vs-audited line, the WARNING for a failed audit."""
    beta, delta = 1.0 - audit.confidence, float(run.cfg.delta)
    result = audit_scores(audit.scores(run.model), audit.included.numpy(), beta=beta, delta=delta, seed=audit.seed)
    claimed = claimed_epsilon(run)
    above = result.rejects(claimed)
    # review 26: m canaries cannot give a bound above their ceiling, so a claim there passes even with no noise at all
    can_refute = claimed is None or claimed < max(result.ceiling, result.ceiling_fdp)
    run.summary["audit"] = {
        "kind": audit.kind, "canaries": audit.canaries, "scored": result.scored, "guesses": result.guesses,
        "correct": result.correct, "epsilon_lower_bound": result.epsilon_lower_bound,
        "epsilon_lower_bound_fdp": result.epsilon_lower_bound_fdp, "guesses_fdp": result.guesses_fdp,
        "correct_fdp": result.correct_fdp, "epsilon_gdp": result.epsilon_gdp, "mu_lower_bound": result.mu_lower_bound,
        "ceiling": result.ceiling, "ceiling_fdp": result.ceiling_fdp, "ceiling_gdp": result.ceiling_gdp,
        "confidence": audit.confidence, "delta": delta, "epsilon_claimed": claimed, "above_claimed": above,
        "can_refute": can_refute,
    }
    text = "none certified" if claimed is None else shown_epsilon(claimed)
    # the audited lower bounds and the ceiling (the largest they can reach) rounded down, never shown above themselves
    # (review 36: %.3f showed a bound of 0.8646 as ">= 0.865")
    low = lambda value: shown_lower_bound(value, 3)  # noqa: E731
    log.info("audit (%s, m=%d): claimed epsilon=%s, audited epsilon >= %s (f-DP: >= %s; %d/%d guesses correct; "
             "ceiling %s) at %.0f%% confidence; Gaussian-shaped estimate %.3f (assumes a Gaussian-shaped privacy "
             "curve: not a bound)", audit.kind, audit.canaries, text, low(result.epsilon_lower_bound),
             low(result.epsilon_lower_bound_fdp), result.correct, result.guesses, low(result.ceiling),
             100 * audit.confidence, result.epsilon_gdp)
    if not can_refute:
        log.warning("audit: the claimed epsilon %s is at or above the largest bound %d canaries can give (%s): this "
                    "audit cannot refute it, whatever the run does (a run without noise passes too); more canaries "
                    "(audit.canaries) raise the ceiling", text, audit.canaries, low(max(result.ceiling, result.ceiling_fdp)))
    if above:
        found = max(result.epsilon_lower_bound, result.epsilon_lower_bound_fdp)
        log.warning("WARNING: PRIVACY AUDIT FAILED: the audited lower bound %s is above the claimed epsilon %s: "
                    "the run does not have the privacy it claims (a bug in sampling, clipping, noise or accounting; "
                    "a run that has it is flagged with probability <= %.2g)", low(found), text, 2 * beta)
