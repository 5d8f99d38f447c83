"""The hidden-state accountant (`accountant=hsa`): Renyi DP of the FINAL model of DP-SBCD (runner/methods/sbcd/).

    acc = ACCOUNTANTS.build("hsa")
    for step in run_steps: acc.step(step)         # HiddenStateStep per training step, in order
    acc.epsilon(1e-5)                             # the hidden-state BOUND (assumptions below; not certified)
    acc.epsilon_composition(1e-5)                 # every intermediate model released: certified, what runs publish

The slides' theorem, made concrete (derivations in docs/sbcd.md):
    eps(alpha) <= 1/(alpha-1) log sum_j0 (b_j0/n) exp((alpha-1) eps_K(alpha, j0)),
    eps_K(alpha, j0) = alpha * sum_d C_d(j0),   C_d = the optimal privacy-amplification-by-iteration cost of layer d
(runner/accountants/hsa_bound.py), then (eps, delta) by minimising over alpha.

The numbers hold ONLY under these assumptions (the accountant cannot check them; docs/sbcd.md discusses each):
  1. hidden state: only the final weights are released; the intermediate weights, the per-example auxiliary
     variables x_d, U_d and the batch partition stay secret;
  2. each block subproblem is convex in theta_d and L-smooth (L = gamma X_d^2; top layer X_D^2 / 2), so the gradient
     map is L_F = max(|1 - eta m|, |1 - eta L|)-Lipschitz and the prox L_T-Lipschitz;
  3. bounded x_d, U_d (clipped to the configured radii) and ||theta_d||_2 <= 1 at the gradient (spectral projection),
     which bound the per-example gradient and so the sensitivity S_g;
  4. when updating theta_d, the auxiliary variables of the batch are treated as fixed inputs (the slides: "we treat
     x_d as a constant"), so each layer is its own noisy iteration and the RDP of the layers adds up;
  5. fixed disjoint batches, drawn uniformly at random once and reused every epoch (sampling=fixed).
It refuses every other mechanism, and DP-SBCD steps with the slides' radial normalisation theta / max(1, Lambda),
which is not 1-Lipschitz in the Frobenius norm (the contraction argument needs the projection).

NOT CERTIFIED for method=sbcd as implemented: the step recomputes U_d and x_d from the current theta_d before the
noisy theta step, and update_u's argmin switches between two candidates, so the map theta -> theta' is not even
continuous (tests/test_sbcd_privacy.py measures a finite-difference ratio ~1e5 against the L_F L_T < 1 the bound
assumes), and the stored auxiliaries make the map depend on the history, not on theta alone. Assumptions 2 and 4 do
not hold, so this number is no guarantee. A run therefore publishes the composition epsilon (certified: each
noisy theta_d update is a Gaussian mechanism of sensitivity eta S_g / b whatever the auxiliaries are) as `epsilon`
and this bound only as `epsilon_hsa_assumed`, labelled as resting on unverified assumptions.
"""
from __future__ import annotations

import numpy as np

from runner.accountants.base import ACCOUNTANTS, Accountant, UnsupportedMechanism
from runner.accountants.hsa_bound import (ALPHAS, composition_cost, mixture_rdp, pabi_cost, pabi_step_costs,
                                          rdp_to_dp)
from runner.accountants.mechanisms import HiddenStateStep, Mechanism


@ACCOUNTANTS.register("hsa")
class HiddenStateAccountant(Accountant):
    name = "hsa"
    supported = (HiddenStateStep,)
    certified = False  # see the module docstring: the implemented step breaks assumptions 2 and 4
    label = "hsa_assumed"
    assumes_sampling = "fixed"

    def __init__(self):
        super().__init__()
        self.sequence: list[HiddenStateStep] = []  # the steps in order (the bound depends on the order)

    def supports(self, mechanism: Mechanism) -> bool:
        return isinstance(mechanism, HiddenStateStep) and mechanism.normalisation == "project"

    def step(self, mechanism: Mechanism, count: int = 1) -> None:
        if isinstance(mechanism, HiddenStateStep) and mechanism.normalisation != "project":
            raise UnsupportedMechanism(
                f"accountant 'hsa' needs method.normalisation=project (a 1-Lipschitz projection); got "
                f"{mechanism.normalisation!r}, whose Frobenius Lipschitz constant breaks the contraction argument")
        super().step(mechanism, count)
        if self.sequence and len(mechanism.noise_std) != len(self.sequence[0].noise_std):
            raise UnsupportedMechanism("accountant 'hsa': all steps must describe the same number of layers")
        self.sequence.extend([mechanism] * count)

    # -- per-key-batch RDP costs ------------------------------------------------------------------------------
    def costs(self, kind: str = "hidden") -> tuple[np.ndarray, np.ndarray]:
        """(C_j, p_j): eps_K(alpha, j) = alpha * C_j for the key example in fixed batch j, and p_j = P(key in j).
        A last entry with C = 0 carries the examples of batches that never ran (capped epochs)."""
        seq = self.sequence
        n = seq[0].n
        batch = np.array([m.batch for m in seq])
        arr = lambda f: np.array([getattr(m, f) for m in seq], float)  # (T, layers)
        s, sh, lf, lt = arr("noise_std"), arr("shift"), arr("lipschitz_grad"), arr("lipschitz_prox")
        sizes = {m.batch: m.batch_size for m in seq}
        js = sorted(sizes)
        C = np.zeros(len(js) + 1)
        for i, j in enumerate(js):
            key = batch == j
            for d in range(s.shape[1]):
                C[i] += (pabi_cost(sh[:, d], s[:, d], lf[:, d], lt[:, d], key) if kind == "hidden"
                         else composition_cost(sh[:, d], s[:, d], key))
        p = np.array([sizes[j] / n for j in js] + [max(0.0, 1.0 - sum(sizes.values()) / n)])
        return C, p

    def epoch_costs(self, j: int = 0) -> np.ndarray:
        """The hidden-state cost (sum over layers) spent in each epoch for a key example in batch j:
        eps_K(alpha, j) = alpha * sum(epoch_costs(j)). (epochs,)"""
        seq = self.sequence
        epochs = np.array([m.epoch for m in seq])
        key = np.array([m.batch for m in seq]) == j
        arr = lambda f: np.array([getattr(m, f) for m in seq], float)
        s, sh, lf, lt = arr("noise_std"), arr("shift"), arr("lipschitz_grad"), arr("lipschitz_prox")
        per_step = sum(pabi_step_costs(sh[:, d], s[:, d], lf[:, d], lt[:, d], key) for d in range(s.shape[1]))
        first = epochs.min()
        return np.bincount(epochs - first, weights=per_step)

    def rdp(self, kind: str = "hidden", alphas: np.ndarray = ALPHAS) -> np.ndarray:
        C, p = self.costs(kind)
        return mixture_rdp(C, p, alphas)

    def _epsilon(self, delta: float) -> float:
        return rdp_to_dp(self.rdp("hidden"), ALPHAS, delta)

    def epsilon_composition(self, delta: float) -> float:
        """The same run accounted as if every intermediate model were released (RDP composition)."""
        if self.steps == 0:
            return 0.0
        return rdp_to_dp(self.rdp("composition"), ALPHAS, delta)

    def certified_epsilon(self, delta: float) -> float:
        return self.epsilon_composition(delta)

