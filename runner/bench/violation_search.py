"""`make bench-search`: search for an input that breaks the certified-clipping contract (issue 26), on every rule.

The contract: one example's contribution to the release, measured in float64, is at most C (1 + 1e-6), for ANY input.
runner/bench/adversarial.py builds one crafted input per rule; this searches around them and around three stacks of
rules (STACKS: Linear / LayerNorm / RMSNorm, conv / GroupNorm, Embedding / Linear), per (construction, setting),
for the input that makes the measured ratio ||released|| / C largest, by three moves:

- restarts: a new sign pattern and read-out (the construction's seed), a new deviation eps = 10^U(-7, -1) from the
  constant input, and one restart in three a new scale of the input (10^U(-20, 15)) and of the read-out (their product
  kept near 1), where one record's squares underflow or overflow float32;
- descent (float inputs): the exact per-example gradient norm ||G(x)|| (float64, autograd's double backward) made
  small at a fixed ||x||, so that every term the rounding of a norm could hide stays O(||x||^2) while the truth goes
  to 0 - the cancellation a float32 Gram cannot see, found by gradient steps on the input instead of built by hand;
- climbing: random relative perturbations of the best input so far (10^U(-7, -2)), kept when the ratio grows;
- then the best input again beside a second example of inf inputs, and of nan inputs, in the same step: that record
  must add nothing, so the release is still the crafted example's alone (a release that is not finite counts as an
  infinite ratio: book-keeping's masked second pass, every method's non-finite rows).

Each point is measured at C = 1%, 90%, 99.9% and (1 - 2^-20) of the exact norm: at C near the norm the clip factor
min(1, C / bound) is where a bound one rounding short would show. The ratio is the step's own release (sigma = 0,
adversarial.measured), not a model of it.

    python -m runner.bench.violation_search --minutes 20              # every construction x every setting
    python -m runner.bench.violation_search --cases linear512_T16 --settings "bk ghost" --restarts 3

    python -m runner.bench.violation_search --device cuda --minutes 2   # a GPU's own TF32 and tensor-core kernels

Output: per (case, setting) the evaluations, the worst ratio and where it was found; outputs/bench/search_<device>.csv.
Exit status 1 when a setting that promises the bound exceeded it (the Opacus peer's uncertified ghost mode, the
positive control, is reported but promises nothing).
"""
from __future__ import annotations

import copy
import math
import os
import re
import time

import pandas as pd
import torch

from torch import nn

from runner.bench.adversarial import (CONSTRUCTIONS, SETTINGS, Cancelling, channels_last, exact_norm, loss_fn, measured,
                                      near_constant, seq, tokens)
from runner.errors import DprunError
from runner.norms import conv, outer
from runner.norms import tensor_cores as tc

TOL = 1e-6  # the contract: ||contribution|| <= C (1 + TOL)
FRACTIONS = (0.01, 0.9, 0.999, 1 - 2**-20)  # C / the exact norm
UNCERTIFIED = ("opacus ghost (timed only)",)  # promises nothing: the search's positive control
# bf16's tensor-core route (compiled steps on a GPU) in both clipped-sum forms: on a GPU its own kernels
# (DPRUN_TENSOR_CORES=1 for the step), on the CPU the exact emulation of their arithmetic (tc.EMULATE)
# and book-keeping's kept conv G_i formed by output rows (runner/norms/conv.py) at every size, not only above
# ROWS_FLOOR_BYTES of unfolded input (the searched layers are small), every G_i kept; and the ghost norm's Grams
# by row blocks over their upper block-triangle (runner/norms/outer.py ghost_norm_sq) at every T >= 4, not only
# from 2 * GRAM_BLOCK_ROWS positions
SEARCH_SETTINGS = dict(SETTINGS, **{"bk bf16 tensor cores split": ("reweight", {}, "bf16", "split"),
                                    "bk bf16 tensor cores single": ("reweight", {}, "bf16", "single"),
                                    # late layers (runner/norms/late.py), off by default on CUDA
                                    "bk late on": ("reweight", {"late": "on"}, "fp32"),
                                    "bk conv rows keep all": ("reweight", {"keep": 1000}, "fp32", "rows"),
                                    "bk ghost blocked Grams": ("reweight", {"norm": "ghost"}, "fp32", "blocks")})
GRAM_BLOCK_ROWS_SEARCHED = 2  # "blocks": T >= 4 positions form their Grams in min(GRAM_BLOCKS, T // 2) blocks
# searched on a GPU only: the CPU runs precision=tf32 as fp32, and late layers are already the CPU's default
GPU_ONLY = ("tf32", "late on")


# whole stacks as well as single layers: each example's bound is the sum of its layers' (their rounding added too),
# and the descent can make every layer cancel at once
STACKS = [
    ("stack_linear_norms_T32", lambda s: Cancelling(nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.Tanh(), nn.Linear(128, 128), nn.RMSNorm(128), nn.Linear(128, 64)),
        torch.zeros(1, 32, 64), seq, s), lambda g, eps: near_constant((32, 64), eps, g)),
    ("stack_conv_groupnorm_8x8", lambda s: Cancelling(nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.Tanh(), nn.Conv2d(32, 32, 3, padding=1)),
        torch.zeros(1, 16, 8, 8), channels_last, s), lambda g, eps: near_constant((16, 8, 8), eps, g)),
    ("stack_embedding_linear", lambda s: Cancelling(nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 64)),
                                                    torch.zeros(1, 33, dtype=torch.long), seq, s),
     lambda g, eps: tokens(33, 10, g)),
]
SEARCHED = [c for cases in CONSTRUCTIONS.values() for c in cases] + STACKS  # (case, build, example)


def settings_for(device: str) -> list[str]:
    return [label for label in SEARCH_SETTINGS if device != "cpu" or not any(w in label for w in GPU_ONLY)]


def ratio(setting: tuple, model, x, device: str = "cpu", neighbour: torch.Tensor | None = None) -> float:
    """The worst ||released|| / C over FRACTIONS; nan where the method refuses the model (one line), inf where the
    release is not finite (one record must never turn it into nan). neighbour: see adversarial.measured."""
    name, cfg, precision, *sum_mode = setting
    saved = tc.EMULATE, tc.SUM, os.environ.get("DPRUN_TENSOR_CORES"), conv.ROWS_FLOOR_BYTES, outer.GRAM_BLOCK_ROWS
    if sum_mode == ["rows"]:  # the conv rows route at every size
        conv.ROWS_FLOOR_BYTES = 0
    elif sum_mode == ["blocks"]:  # the blocked Grams at every T >= 4
        outer.GRAM_BLOCK_ROWS = GRAM_BLOCK_ROWS_SEARCHED
    elif sum_mode:  # the bf16 tensor-core route with this clipped sum
        tc.SUM = sum_mode[0]
        if device == "cpu":
            tc.EMULATE = True
        else:
            os.environ["DPRUN_TENSOR_CORES"] = "1"
    try:
        worst = max(measured(name, cfg, model, x, f, precision, device, neighbour=neighbour) for f in FRACTIONS)
        return worst if math.isfinite(worst) else math.inf
    except DprunError:
        return math.nan
    finally:
        tc.EMULATE, tc.SUM, conv.ROWS_FLOOR_BYTES, outer.GRAM_BLOCK_ROWS = saved[0], saved[1], saved[3], saved[4]
        if saved[2] is None:
            os.environ.pop("DPRUN_TENSOR_CORES", None)
        else:
            os.environ["DPRUN_TENSOR_CORES"] = saved[2]


def scaled(model, x, g: torch.Generator):
    """The input times 10^U(-20, 15) and the read-out by about the inverse (10^U(-8, 2) left over): the product, the
    gradient, stays ordinary while one record's squares leave float32's normal range."""
    log_in = float(torch.empty(()).uniform_(-20, 15, generator=g))
    log_out = float(torch.empty(()).uniform_(-8, 2, generator=g)) - log_in
    model.readout.mul_(10.0 ** log_out)
    return x * 10.0 ** log_in


def descent(model, x: torch.Tensor, steps: int):
    """Iterates of gradient descent on log ||G(x)||^2 (the exact per-example gradient, float64) at fixed ||x||, each
    step the best of a line search over 10^-1 .. 10^-8 ||x||: the input driven towards cancellation, whatever the
    layer (autograd's double backward through it)."""
    m = copy.deepcopy(model).double()
    params = [p for p in m.parameters() if p.requires_grad]

    def objective(z, graph=False):
        grads = torch.autograd.grad(loss_fn(m(z), None).sum(), params, create_graph=graph)
        return torch.log(sum(gr.pow(2).sum() for gr in grads))

    z = x.double()
    radius = z.norm()
    for _ in range(steps):
        z = z.detach().requires_grad_(True)
        value = objective(z, graph=True)
        (slope,) = torch.autograd.grad(value, z)
        if not torch.isfinite(slope).all() or slope.norm() == 0:
            return
        direction = slope / slope.norm()

        def moved(log_step):  # (score, point) of a step of 10^log_step ||x||, back on the sphere
            c = (z - 10.0 ** log_step * radius * direction).detach()
            c = (c * (radius / c.norm())).requires_grad_(True)
            score = objective(c).item()
            return (score if math.isfinite(score) else math.inf), c.detach()

        coarse = min(range(-8, 0), key=lambda k: moved(k)[0])  # 10^-8 .. 10^-1, then 1/8 decades around the best
        score, best = min((moved(coarse + j / 8) for j in range(-8, 9)), key=lambda sc: sc[0])
        if not score < value.item():
            return
        z = best
        yield z.float()


def search_one(case: str, build, example, label: str, restarts: range, deadline: float, seed: int = 0,
               steps: int = 8, climbs: int = 6, device: str = "cpu") -> dict:
    """The worst ratio found for one construction and setting over the restarts numbered `restarts` (each its own
    pattern, read-out and input), stopping at `deadline` (time.monotonic); where = (restart, move, iteration)."""
    setting = SEARCH_SETTINGS[label]
    worst, where, evaluations, done = -math.inf, None, 0, 0

    def note(r, at):
        nonlocal worst, where, evaluations
        evaluations += 1
        if r > worst:
            worst, where = r, at
        return r

    for restart in restarts:
        if time.monotonic() >= deadline:
            break
        done += 1
        g = torch.Generator().manual_seed(seed + restart)
        torch.manual_seed(seed + restart)
        model = build(restart)
        x = example(g, 10.0 ** float(torch.empty(()).uniform_(-7, -1, generator=g)))
        if x.is_floating_point() and restart % 3 == 2:
            x = scaled(model, x, g)
        best = note(ratio(setting, device=device, model=model, x=x), (restart, "start", 0))
        if math.isnan(best):
            break  # refused: every input of this model is
        if not x.is_floating_point() or not 0 < exact_norm(model, x) < math.inf:
            continue  # token ids: restarts only
        for i, z in enumerate(descent(model, x, steps)):
            if not 0 < exact_norm(model, z) < math.inf:
                break
            r = note(ratio(setting, device=device, model=model, x=z), (restart, "descent", i + 1))
            if r > best:
                best, x = r, z
        for i in range(climbs):
            size = 10.0 ** float(torch.empty(()).uniform_(-7, -2, generator=g))
            z = x + size * x.abs().mean() * torch.randn(x.shape, generator=g)
            if not 0 < exact_norm(model, z) < math.inf:
                continue
            r = note(ratio(setting, device=device, model=model, x=z), (restart, "climb", i + 1))
            if r > best:
                best, x = r, z
        for value in (math.inf, math.nan):  # the best input beside a record whose gradient is not finite
            note(ratio(setting, model, x, device, torch.full_like(x, value)), (restart, f"beside {value}", 0))
    return dict(case=case, setting=label, restarts=done, evaluations=evaluations,
                worst=worst if evaluations else math.nan, where=where,
                promises=label not in UNCERTIFIED)


def search(cases: list[str] | None = None, settings: list[str] | None = None, minutes: float | None = None,
           restarts: int | None = None, seed: int = 0, steps: int = 8, climbs: int = 6, progress=print,
           device: str = "cpu") -> pd.DataFrame:
    """Every (construction, setting) pair, round after round (one restart each) until `minutes` or `restarts`."""
    pairs = [(case, build, example, label) for case, build, example in SEARCHED for label in settings_for(device)
             if (cases is None or case in cases) and (settings is None or label in settings)]
    if not pairs:
        raise DprunError(f"bench-search: nothing to search for cases={cases} settings={settings}; valid cases: "
                         f"{', '.join(c for c, _, _ in SEARCHED)}; settings: "
                         f"{', '.join(settings_for(device))}")
    deadline = time.monotonic() + (60 * minutes if minutes is not None else math.inf)
    rows: dict = {}
    rounds = restarts if restarts is not None else math.inf
    r = 0
    while r < rounds and time.monotonic() < deadline:
        for case, build, example, label in pairs:
            if time.monotonic() >= deadline:
                break
            found = search_one(case, build, example, label, range(r, r + 1), deadline, seed, steps, climbs, device)
            before = rows.setdefault((case, label), dict(found, restarts=0, evaluations=0, worst=-math.inf))
            before["restarts"] += found["restarts"]  # running totals over the rounds
            before["evaluations"] += found["evaluations"]
            if found["worst"] > before["worst"] or math.isnan(found["worst"]):
                before["worst"], before["where"] = found["worst"], found["where"]
        r += 1
        worst = max((v["worst"] for v in rows.values() if v["promises"] and not math.isnan(v["worst"])),
                    default=math.nan)
        progress(f"[bench-search] round {r}: {sum(v['evaluations'] for v in rows.values())} points, worst ratio "
                 f"{worst:.9f} among the settings that promise the bound")
    return pd.DataFrame(rows.values())


def main(argv=None) -> int:
    from runner.bench.common import save_frames
    from runner.entry import OneLineParser

    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="search until then (default: --restarts rounds)")
    parser.add_argument("--restarts", type=int, default=None, help="rounds of one restart per pair (default 3 "
                        "without --minutes)")
    parser.add_argument("--cases", default=None, help="comma-separated constructions (default: all)")
    parser.add_argument("--settings", default=None, help="comma-separated settings (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the steps run: cpu, or cuda (its own TF32 and "
                        "tensor-core arithmetic, and the tf32 settings); the exact norms and the descent on the CPU")
    parser.add_argument("--out", default="outputs/bench", help="folder for search_<device>.csv")
    args = parser.parse_args(argv)
    restarts = args.restarts if args.restarts is not None or args.minutes is not None else 3
    # settings split at commas outside parentheses: "reweight (defaults: bk, auto)" is one
    table = search(args.cases.split(",") if args.cases else None,
                   [label.strip() for label in re.split(r",(?![^(]*\))", args.settings)] if args.settings else None,
                   args.minutes, restarts, args.seed, device=args.device)
    with pd.option_context("display.max_rows", None, "display.width", 250):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.9f}"))
    save_frames([table], args.out, "search", torch.device(args.device), False, "bench-search")
    broken = table[table.promises & (table.worst > 1 + TOL)]
    if len(broken):
        print(f"[bench-search] VIOLATION: {len(broken)} (case, setting) pairs released more than C (1 + {TOL:g}): "
              + "; ".join(f"{r.case} / {r.setting}: {r.worst:.9g} at {r.where}" for r in broken.itertuples()))
        return 1
    print(f"[bench-search] no violation: every setting that promises the bound stayed <= C (1 + {TOL:g})")
    return 0


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.violation_search"))
