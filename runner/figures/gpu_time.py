"""Estimated GPU time of each target at scale=paper, with its basis (printed by `make figures-list`).

These are estimates, not measurements. The step-cost model: a small model's forward+backward is launch-bound at
about 3 ms eager on an H100 (measured with runner/bench/clip.py: the MNIST CNN's non-private step is 2.9 ms); nxBP
costs one backward per example (B x 3 ms per step); multiLoss, ReweightGP, Opacus and non-private cost a few such
passes per step; DP-SGD-JL(r) costs about r forward-mode passes. Where the paper gives seconds per epoch (JL Tables 2, 3, 5 on a
Tesla P100), their sum x epochs is quoted as an upper bound. Trained figures sharing a preset share its runs (the
time is counted once, at the first of them). Computed targets need no GPU (CPU seconds to minutes).
"""
from __future__ import annotations

# name -> (estimated GPU hours at scale=paper, basis)
PAPER_GPU_HOURS: dict[str, tuple[float, str]] = {
    "jl_table1": (0.0, "computed from the registries (CPU, seconds)"),
    "jl_fig2": (0.0, "computed with scipy (CPU, seconds)"),
    "jl_fig7": (0.0, "computed by the jl accountant (CPU, 1-3 minutes)"),
    "jl_epsilon_r": (0.0, "computed by the jl and pld accountants (CPU, about 10 minutes for 8 r x 2 panels)"),
    "jl_table4": (0.01, "runner.bench: 7 contenders x 11 steps of the MNIST CNN at B=256"),
    "jl_fig3": (0.8, "MNIST 15 epochs x 235 steps: nxBP 256 x 3 ms/step = 44 min; 5 other runs about 2 min each"),
    "jl_table2": (1.0, "CIFAR-10 20 epochs x 196 steps: nxBP 256 x 3 ms/step = 50 min; 4 other runs < 5 min each "
                       "(the paper's P100 s/epoch x 20 sum to 6.7 h: an upper bound)"),
    "jl_fig1": (0.0, "reads jl_table2's runs"),
    "jl_fig4": (0.0, "reads jl_table2's runs"),
    "jl_table3": (0.7, "IMDB BiLSTM, 98 steps/epoch at ~10 ms per pass: nxBP 4 epochs x 256 passes = 17 min, JL(30) "
                       "20 epochs = 10 min, the rest < 10 min (the paper's P100 s/epoch sum to 21 h, 15.5 h of it "
                       "Vanilla: an upper bound)"),
    "jl_fig5": (0.0, "reads jl_table3's runs"),
    "jl_fig6": (0.0, "reads jl_table3's runs"),
    "jl_table5": (1.5, "VGG13 CIFAR-10 20 epochs x 196 steps at B=256: nxBP about 50 min, JL(10) about 20 min, "
                       "Outer/non-private < 10 min (the paper's P100 numbers sum to 21 h)"),
    "lk_fig5": (72.0, "13 (model, data) pairs x 100 epochs; nxBP = N x 3 ms = 180 s/epoch dominates (about 3.6 h "
                      "with epochs=5, enough for seconds per epoch)"),
    "lk_fig6": (75.0, "3 models x 4 batch sizes x 100 epochs; nxBP = N x 3 ms = 180 s/epoch at every B (3.75 h "
                      "with epochs=5)"),
    "lk_fig7": (67.0, "4 depths x 3 datasets x 100 epochs at B=128; nxBP 180 s/epoch dominates (3.3 h with "
                      "epochs=5)"),
    "lk_fig8": (0.5, "7 models x 2 sizes x 4 methods, one 2,000-image epoch; nxBP at ResNet-101/256 px about 30 ms "
                     "per image"),
    "lk_fig9": (0.1, "ResNet-18, 4 sizes x 4 methods, one 2,000-image epoch"),
    "lk_memory": (0.1, "ResNet-101 at 256 px, 3 methods x 11 batch sizes x 3 steps"),
    "sbcd_hsa_vs_composition": (0.0, "computed by the HSA accountant (CPU, seconds)"),
    "sbcd_epoch_contribution": (0.0, "computed by the HSA accountant (CPU, seconds)"),
    "sbcd_adaptive_noise": (0.0, "two sigma calibrations and two DP-SBCD MNIST runs on the CPU (smoke: 10 epochs, a "
                            "minute; paper: 50 epochs, ~5 minutes)"),
}


def estimate(name: str) -> str:
    hours, basis = PAPER_GPU_HOURS.get(name, (float("nan"), "no estimate"))
    if hours == 0:
        when = "shared" if basis.startswith("reads") else "no GPU"
    else:
        when = f"~{hours * 60:.0f} min" if hours < 1 else f"~{hours:.1f} h"
    return f"{when:>9s}  ({basis})"
