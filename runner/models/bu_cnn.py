"""The JL paper's MNIST CNN (Bu et al. 2019; TF Privacy's MNIST tutorial), ReLU throughout:

    Conv(16, 8x8, stride 2, TF 'same') -> MaxPool(2, stride 1) -> Conv(32, 4x4, stride 2, valid)
    -> MaxPool(2, stride 1) -> Flatten -> Dense(32) -> Dense(classes)

26,010 parameters on MNIST (1x28x28: 28 -> 14 -> 13 -> 5 -> 4, 32*4*4 = 512 features).

TF's 'same' padding with stride 2 pads (total // 2) before and the rest after, which can be asymmetric; it is
done by a parameter-free TFSamePad2d before a padding=0 Conv2d, so per-layer norm rules see a plain Conv2d.

    MODELS.build("bu_cnn", info)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.memory_format import prefer_channels_last_on_cpu
from runner.models.base import MODELS, flat_size, require_image


class TFSamePad2d(nn.Module):
    """Zero padding that makes a following Conv2d(kernel, stride, padding=0) behave like TF's padding='same'."""

    def __init__(self, kernel: int, stride: int):
        super().__init__()
        self.kernel, self.stride = kernel, stride

    def amounts(self, size: int) -> tuple[int, int]:
        total = max((math.ceil(size / self.stride) - 1) * self.stride + self.kernel - size, 0)
        return total // 2, total - total // 2  # (before, after)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, H + ph, W + pw)
        top, bottom = self.amounts(x.shape[-2])
        left, right = self.amounts(x.shape[-1])
        return F.pad(x, (left, right, top, bottom))


@MODELS.register("bu_cnn")
def build_bu_cnn(info, widths=(16, 32), hidden: int = 32):
    c, h, w = require_image(info, "bu_cnn", min_side=12)
    features = nn.Sequential(
        TFSamePad2d(8, 2), nn.Conv2d(c, int(widths[0]), 8, stride=2), nn.ReLU(), nn.MaxPool2d(2, stride=1),
        nn.Conv2d(int(widths[0]), int(widths[1]), 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, stride=1),
        nn.Flatten(),
    )
    return prefer_channels_last_on_cpu(nn.Sequential(  # its pooling: several times faster channels-last on the CPU
        features, nn.Linear(flat_size(features, info.input_shape), int(hidden)), nn.ReLU(),
        nn.Linear(int(hidden), info.num_classes)))
