"""The network DP-SBCD trains and releases: model=mlp's weights, as a bias-free ReLU MLP with clipped activations."""
from __future__ import annotations

import torch
from torch import nn

from runner.methods.sbcd.updates import clip_rows


class SBCDNet(nn.Module):
    """x -> flatten -> clip to X_0 -> relu(theta_d x) (clipped to X_{d+1}) ... -> theta_D x_D. (B, ...) -> (B, C)"""

    def __init__(self, weights: list[torch.Tensor], x_radius: list[float]):
        super().__init__()
        self.thetas = nn.ParameterList([nn.Parameter(w.detach().clone()) for w in weights])
        self.x_radius = list(x_radius)

    def forward(self, x):
        x = clip_rows(x.flatten(1), self.x_radius[0])
        for d, theta in enumerate(self.thetas[:-1]):
            x = clip_rows(torch.relu(x @ theta.T), self.x_radius[d + 1])
        return x @ self.thetas[-1].T
