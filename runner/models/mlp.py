"""Lee & Kifer's MLP: hidden layers 128 then 256 (then 256 ...), sigmoid, linear output.

depth = number of hidden layers (L&K figure 7 sweeps 2..8). On MNIST, depth 2: 136,074 parameters.

    MODELS.build("mlp", info, depth=4)
"""
from __future__ import annotations

import math

from torch import nn

from runner.models.base import MODELS, require_image

ACTIVATIONS = {"sigmoid": nn.Sigmoid, "relu": nn.ReLU, "tanh": nn.Tanh}  # model.activation (runner/validate.py)


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, depth: int, widths: tuple[int, ...], activation: str):
        super().__init__()
        act = ACTIVATIONS[activation]
        sizes = [in_features] + [widths[min(i, len(widths) - 1)] for i in range(depth)]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), act()]
        layers.append(nn.Linear(sizes[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):  # (B, *input_shape) -> (B, classes)
        return self.net(x)


@MODELS.register("mlp")
def build_mlp(info, depth: int = 2, widths=(128, 256), activation: str = "sigmoid"):
    require_image(info, "mlp")  # token ids are not features; text models: bilstm, transformer, rnn, lstm, gru
    return MLP(math.prod(info.input_shape), info.num_classes, int(depth), tuple(widths), activation)
