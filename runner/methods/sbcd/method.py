"""DP-SBCD (`method=sbcd`): private stochastic block coordinate descent on the lifted ReLU-MLP objective.

    dprun method=sbcd dataset=digits batch_size=360 epochs=40          # accountant=auto -> hsa, sampling -> fixed
    dprun method=sbcd dataset=mnist model=mlp data_dir=/work/shared/data batch_size=2000 sigma=2

Network x_{d+1} = relu(theta_d x_d), d = 0..D-1, logits theta_D x_D; lifted objective (updates.py)
    F = CE(theta_D x_D; y) + gamma/2 sum_{d<D} (||x_{d+1} - relu(U_d)||^2 + ||U_d - theta_d x_d||^2).
The auxiliary x_d (d >= 1), U_d of ALL N training examples live on the device and are never released. Per fixed
batch, for d = 0..D: x_d <- argmin F (closed form; top: gradient steps), U_d <- argmin F (elementwise), clip both to
their radii, theta_d <- spectral projection, theta_d <- Prox(theta_d - eta grad + N(0, s_d^2 I)) with
s_d = sigma_k * eta * S_g,d / b. No per-example clipping: the radii and the projection bound the sensitivity.

The model: theta_d are taken from model=mlp's nn.Linear weights (any activation, depth, widths); the network trained
and evaluated is that MLP's bias-free ReLU version (SBCDNet). Biases are dropped, not folded in: a constant-1
coordinate of x_d would be moved by the x_d update. Other models are refused. Needs sampling=fixed (set by
`Method.sampling`); each step tells the accountant a HiddenStateStep (bounds.hidden_state_step; accountant=hsa).
Method.step runs it: step_mechanism (the batch's place in the partition), privatize (the released network's losses
before the step), update (the block updates; the noise through runner/methods/noise.py's add_gaussian).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from runner.accountants.mechanisms import HiddenStateStep
from runner.errors import DprunError
from runner.methods.base import METHODS, SCALE_RANGE, SCALE_TEXT, Method, Privatized
from runner.methods.noise import add_gaussian
from runner.methods.sbcd import updates as up
from runner.methods.sbcd.bounds import hidden_state_step, network_constants
from runner.methods.sbcd.net import SBCDNet
from runner.methods.sbcd.schedule import noise_multiplier
from runner.methods.features import Feature
from runner.models.mlp import MLP  # the one model family it trains (a lower floor)

log = logging.getLogger("dprun")
REGULARISERS = ("none", "l2", "l1")
NORMALISATIONS = ("project", "radial")


def per_layer(value, count: int, name: str) -> list[float]:
    """A scalar radius for every layer, or a list of exactly `count` values."""
    values = [float(value)] * count if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != count or min(values, default=1.0) <= 0:
        raise DprunError(f"method.{name} must be a positive number or {count} positive numbers, got {value}")
    return values


@METHODS.register("sbcd")
class SBCD(Method):
    name = "sbcd"
    exact = False
    default_accountant = "hsa"
    sampling = "fixed"  # the hidden-state analysis assumes fixed disjoint batches, each example once per epoch
    updates_model = True  # the block updates set the weights; no gradient, no optimizer
    not_resumable = "method=sbcd keeps auxiliary variables for every training example that are not checkpointed"
    summary = "layer-wise block coordinate descent, spectral projection, noisy prox step; hidden-state accounting"

    def prepare(self, model: nn.Module, data=None) -> nn.Module:
        if not isinstance(model, MLP):
            raise DprunError(f"method=sbcd trains a bias-free ReLU MLP built from model=mlp; got model "
                             f"{type(model).__name__}: add model=mlp")
        if data is None:
            raise DprunError("method=sbcd keeps per-example auxiliary variables: call method.attach(model, data)")
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.depth = len(linears) - 1  # D
        self.gamma = float(self.option("gamma", 1.0))
        self.eta = float(self.option("eta", 1.5))
        self.reg = self.choice("reg", "l2", REGULARISERS)
        self.lam = float(self.option("reg_lambda", 0.05))
        self.normalisation = self.choice("normalisation", "project", NORMALISATIONS)
        self.schedule = str(self.option("noise_schedule", "constant"))
        self.epochs = int(self.option("epochs", 1))
        self.x_radius = per_layer(self.option("x_radius", 1.0), self.depth + 1, "x_radius")
        self.u_radius = per_layer(self.option("u_radius", 1.0), self.depth, "u_radius")
        if self.eta <= 0 or self.gamma <= 0 or self.lam < 0:
            raise DprunError(f"method.eta={self.eta} and method.gamma={self.gamma} must be > 0, reg_lambda >= 0")
        noise_multiplier(self.schedule, sigma=self.sigma, epoch=0, epochs=self.epochs, **self._decay())  # validate
        self.consts = network_constants(depth=self.depth, gamma=self.gamma, x_radius=self.x_radius,
                                        u_radius=self.u_radius, eta=self.eta, reg=self.reg, lam=self.lam)
        net = SBCDNet([lin.weight for lin in linears], self.x_radius).to(linears[0].weight.device)
        if getattr(model, "net", None) is not None and not any(isinstance(m, nn.ReLU) for m in model.modules()):
            log.info("method=sbcd: training the model's bias-free ReLU version (the lifted objective's network)")
        self._init_auxiliary(net, data.train_x)
        self.n = len(data.train_y)
        self.batch_of = torch.full((self.n,), -1, dtype=torch.long, device=data.train_y.device)  # fixed batch ids
        self.num_seen, self.last_batch, self.epoch, self.power_v = 0, -1, 0, [None] * (self.depth + 1)
        return net

    def unsupported(self, feature: Feature) -> str | None:
        """Its step is not a clipped gradient sum: the block updates read and write the auxiliary variables of the
        whole fixed batch at once, and its hidden-state noise is calibrated to that batch."""
        return {Feature.PHYSICAL_BATCH: "its block updates read and write the whole fixed batch's auxiliary "
                                        "variables at once (run it without physical_batch_size)",
                Feature.BF16: "its spectral projection and prox step are calibrated in full precision",
                Feature.DISTRIBUTED: "its auxiliary variables (one per training example) live in one process",
                }.get(feature)

    def _decay(self) -> dict:
        return {"decay": float(self.option("noise_decay", 0.9)), "floor": float(self.option("noise_floor", 0.25))}

    @torch.no_grad()
    def _init_auxiliary(self, net: SBCDNet, train_x: torch.Tensor, chunk: int = 8192) -> None:
        """x_d, U_d of all N examples from a forward pass: U_d = theta_d x_d, x_{d+1} = relu(U_d), clipped."""
        thetas = list(net.thetas)
        self.xs = [None] + [torch.empty(len(train_x), t.shape[0], dtype=t.dtype, device=t.device) for t in thetas[:-1]]
        self.us = [torch.empty_like(x) for x in self.xs[1:]]
        for i in range(0, len(train_x), chunk):
            x = up.clip_rows(train_x[i:i + chunk].flatten(1).to(thetas[0].dtype), self.x_radius[0])
            for d, theta in enumerate(thetas[:-1]):
                u = up.clip_rows(x @ theta.T, self.u_radius[d])
                x = up.clip_rows(torch.relu(u), self.x_radius[d + 1])
                self.us[d][i:i + chunk], self.xs[d + 1][i:i + chunk] = u, x

    def _batch_position(self, idx: torch.Tensor) -> int:
        """The fixed batch's position j in the partition; advances the epoch when the partition restarts."""
        ids = self.batch_of[idx]
        if bool((ids == -1).all()):
            self.batch_of[idx] = self.num_seen
            j, self.num_seen = self.num_seen, self.num_seen + 1
        elif bool((ids == ids[0]).all()):
            j = int(ids[0])
        else:
            raise DprunError("method=sbcd needs sampling=fixed (the same disjoint batches every epoch)")
        if j <= self.last_batch:
            self.epoch += 1
        self.last_batch = j
        return j

    def mechanism(self, sample_rate: float, batch_size: int | None = None, batch: int = 0) -> HiddenStateStep:
        """The step's description (bounds.hidden_state_step, shared with runner/sbcd_curves.py)."""
        b = max(1, round(sample_rate * self.n))
        sigma_k = noise_multiplier(self.schedule, sigma=self.sigma, epoch=self.epoch, epochs=self.epochs,
                                   **self._decay())
        step = hidden_state_step(self.consts, eta=self.eta, sigma_k=sigma_k, b=b, n=self.n, epoch=self.epoch,
                                 batch=batch, batch_size=batch_size or b, normalisation=self.normalisation)
        low, high = SCALE_RANGE  # as for C and sigma * C (runner/methods/base.py): float32 rounds the noise and the
        scales = [*step.shift, *(step.noise_std if sigma_k > 0 else ())]  # shift to 0 or inf outside it (review 7:
        if any(not low <= float(v) <= high for v in scales):  # x_radius=u_radius=1e-25 drew noise 0; 1e20, inf)
            raise DprunError(f"method=sbcd: its noise std and shift per layer ({min(map(float, scales)):.3g} .. "
                             f"{max(map(float, scales)):.3g}, from eta={self.eta:g}, sigma={self.sigma:g} and the "
                             f"radii) must lie in {SCALE_TEXT}; accepted: eta, x_radius and u_radius that keep them "
                             f"there (float32 rounds the noise to 0 or inf outside)")
        return step

    def step_mechanism(self, sample_rate: float, indices: torch.Tensor | None) -> HiddenStateStep:
        if indices is None:
            raise DprunError("method=sbcd needs the batch's example indices (indices=...) for its auxiliary variables")
        if len(indices) == 0:
            raise DprunError("method=sbcd: an empty batch; its fixed batches (sampling=fixed) are never empty")
        return self.mechanism(sample_rate, batch_size=len(indices), batch=self._batch_position(indices))

    def _normalise(self, d: int, theta: torch.Tensor) -> torch.Tensor:
        if self.normalisation == "project":
            return up.spectral_project(theta)
        lam, self.power_v[d] = up.power_iteration(theta, self.power_v[d], int(self.option("power_iters", 20)))
        return up.radial_normalise(theta, lam)

    @torch.no_grad()
    def privatize(self, model, loss_fn, x, y) -> Privatized:
        outputs = model(x)  # (B, classes): the released network's predictions before this step
        return Privatized(loss_fn(outputs, y).detach(), outputs.detach(), None)

    @torch.no_grad()
    def update(self, model, optimizer, mechanism: HiddenStateStep, *, x, y, indices, expected_batch_size: float,
               generator: torch.Generator | None) -> None:
        """The block updates of one fixed batch, d = 0..D (the optimizer is not used)."""
        D, thetas = self.depth, list(model.thetas)
        xs = [up.clip_rows(x.flatten(1).to(thetas[0].dtype), self.x_radius[0])] + [t[indices] for t in self.xs[1:]]
        us = [t[indices] for t in self.us]  # xs[d] (B, n_d), us[d] (B, n_{d+1})
        for d in range(D + 1):
            theta = thetas[d].data
            if 1 <= d < D:
                xs[d] = up.clip_rows(up.update_x_middle(us[d - 1], theta, us[d]), self.x_radius[d])
            elif d == D and D >= 1:
                xs[d] = up.clip_rows(up.update_x_top(xs[d], theta, y, torch.relu(us[d - 1]), self.gamma,
                                                     int(self.option("x_top_steps", 5))), self.x_radius[d])
            if d < D:
                us[d] = up.clip_rows(up.update_u(xs[d] @ theta.T, xs[d + 1]), self.u_radius[d])
            theta = self._normalise(d, theta)
            b = float(expected_batch_size)  # nominal batch size: the divisor of the gradient sum
            grad = up.grad_top(theta, xs[d], y, b) if d == D else up.grad_middle(theta, xs[d], us[d], self.gamma, b)
            noisy = add_gaussian(theta - self.eta * grad, mechanism.noise_std[d], generator)
            thetas[d].data = up.prox(noisy, self.reg, self.eta, self.lam)
        for d in range(1, D + 1):
            self.xs[d][indices] = xs[d]
        for d in range(D):
            self.us[d][indices] = us[d]
