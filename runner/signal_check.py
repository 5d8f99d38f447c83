"""How much signal survives clipping, next to the noise DP adds: exact clipping vs JL(r)'s estimated norms.

    python -m runner.signal_check dataset=imdb data_dir=../shared/data                 # 4 batches of 256, at init
    python -m runner.signal_check dataset=imdb data_dir=../shared/data clip=1 sigma=0.6 r=1 +check.batches=8
    python -m runner.signal_check dataset=mnist data_dir=../shared/data                # MNIST's paper setting

For a few Poisson-sized batches of the training split (the run's model at its initialisation, the run's clip C and
noise sigma), one line per method (exact = ReweightGP's norms; JL(r) for each r in check.r):

    per-example gradient norm quantiles (JL: the estimated norms that set the clip factors)
    unclipped   share of examples whose factor is 1 (norm <= C)
    |S|         norm of the clipped sum S = sum_i nu_i g_i
    |S|/|N|     against the norm of the noise DP adds to it, sigma*C*sqrt(d) (d trainable parameters)
    cos(S, G)   alignment of S with the unclipped batch gradient G = sum_i g_i

Exact clipping bounds |S| <= B*C (each clipped gradient has norm <= C). JL(r)'s factor is C / (estimated norm), and
an estimate below the true norm lets an example through with more than C: |S| can exceed B*C, which is the signal
that the noise, calibrated to C, was not sized for, and why the JL accountant finds no finite epsilon (docs/privacy.md).
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import torch
from omegaconf import OmegaConf

from runner import models
from runner.data import load_dataset
from runner.methods import METHODS
from runner.methods.base import trainable


def per_example_loss(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(outputs, y, reduction="none")  # (B,)


def clipped_sum(method, model, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat clipped sum S (d,), the norms the method clipped by (B,)): privatize leaves S in p.grad, no noise."""
    for p in model.parameters():
        p.grad = None
    out = method.privatize(model, per_example_loss, x, y)
    flat = torch.cat([p.grad.detach().reshape(-1) for p in trainable(model)])
    return flat, out.norms.detach()


def batch_gradient(model, x, y) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    per_example_loss(model(x), y).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in trainable(model)])


def measure(cfg, batches: int = 4, rs: tuple[int, ...] = (1,), seed: int = 0) -> list[dict]:
    """One row per (method, batch): the quantities of the module docstring."""
    torch.manual_seed(seed)
    data = load_dataset(cfg.dataset, cfg.data_dir, torch.device("cpu"))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    kwargs = {k: v for k, v in model_cfg.items() if k not in ("name", "kwargs")}
    kwargs.update(model_cfg.get("kwargs") or {})
    model = models.build(str(cfg.model.name), data.info, **models.knobs(str(cfg.model.name), **kwargs))
    clip, sigma, B = float(cfg.clip), float(cfg.sigma), int(cfg.batch_size)
    contenders = {"exact": METHODS.build("reweight", clip=clip, sigma=sigma)}
    contenders |= {f"JL({r})": METHODS.build("jl", cfg={"r": int(r)}, clip=clip, sigma=sigma) for r in rs}
    contenders = {name: (m, m.attach(model)) for name, m in contenders.items()}
    d = sum(p.numel() for p in trainable(model))
    noise = sigma * clip * math.sqrt(d)  # norm of N(0, (sigma C)^2 I_d)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batches):
        idx = torch.randperm(len(data.train_y), generator=g)[:B]
        x, y = data.train_x[idx], data.train_y[idx]
        full = batch_gradient(model, x, y)
        for name, (method, m) in contenders.items():
            s, norms = clipped_sum(method, m, x, y)
            q = torch.quantile(norms.float(), torch.tensor([0.1, 0.5, 0.9]))
            rows.append({"method": name, "batch": b, "B": B, "d": d, "clip": clip, "sigma": sigma,
                         "norm_p10": float(q[0]), "norm_median": float(q[1]), "norm_p90": float(q[2]),
                         "unclipped": float((norms <= clip).float().mean()), "signal": float(s.norm()),
                         "signal_bound": B * clip, "noise": noise, "snr": float(s.norm()) / noise,
                         "cos_to_gradient": float(torch.nn.functional.cosine_similarity(s, full, dim=0))})
    return rows


def summary_table(rows: list[dict]):
    import pandas as pd

    t = pd.DataFrame(rows)
    cols = ["norm_p10", "norm_median", "norm_p90", "unclipped", "signal", "signal_bound", "noise", "snr",
            "cos_to_gradient"]
    return t.groupby("method", sort=False)[cols].mean().reset_index()


def main(argv: Optional[list[str]] = None) -> int:
    from runner.paths import compose

    from runner.overrides import check_group_choices

    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(__doc__.split("\n\n")[0] + "\n\nUsage:\n" + __doc__.split("\n\n")[1])
        return 0
    check_group_choices(argv)  # dataset=nope: one line naming the choices
    check = {"batches": 4, "r": "1"}
    rest = []
    for a in argv:
        key = a.lstrip("+")
        if key.startswith("check."):
            k, v = key[len("check."):].split("=", 1)
            check[k] = v
        else:
            rest.append(a)
    cfg = compose(rest)
    rs = tuple(int(r) for r in str(check["r"]).split(","))
    rows = measure(cfg, int(check["batches"]), rs, int(cfg.seed))
    print(f"signal_check: dataset={cfg.dataset.name} model={cfg.model.name} B={cfg.batch_size} C={cfg.clip} "
          f"sigma={cfg.sigma}, {check['batches']} batches, model at initialisation (seed {cfg.seed})")
    print(summary_table(rows).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


if __name__ == "__main__":
    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.signal_check"))
