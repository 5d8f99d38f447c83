"""Lee & Kifer's CNN: Conv(20, 5x5) -> ReLU -> MaxPool 2 -> Conv(50, 5x5) -> ReLU -> MaxPool 2 -> FC 128 -> ReLU -> FC.

Stride 1 and no zero padding, as in the paper: 129,388 parameters on MNIST (1x28x28), 187,988 on CIFAR-10
(3x32x32). Images smaller than 16x16 (the 8x8 digits) cannot take two valid 5x5 convolutions and pools, so
there both convolutions use padding=2 ('same'), giving 8 -> 4 -> 2 and 52,588 parameters on digits.

    MODELS.build("cnn", info)                 # info.input_shape = (C, H, W)
"""
from __future__ import annotations

from torch import nn

from runner.memory_format import prefer_channels_last_on_cpu
from runner.models.base import MODELS, flat_size, require_image


@MODELS.register("cnn")
def build_cnn(info, widths=(20, 50), hidden: int = 128, kernel: int = 5):
    c, h, w = require_image(info, "cnn", min_side=4)
    padding = 0 if min(h, w) >= 16 else kernel // 2
    layers: list[nn.Module] = []
    for width in widths:
        layers += [nn.Conv2d(c, int(width), kernel, padding=padding), nn.ReLU(), nn.MaxPool2d(2)]
        c = int(width)
    features = nn.Sequential(*layers, nn.Flatten())
    return prefer_channels_last_on_cpu(nn.Sequential(  # its pooling: several times faster channels-last on the CPU
        features, nn.Linear(flat_size(features, info.input_shape), int(hidden)), nn.ReLU(),
        nn.Linear(int(hidden), info.num_classes)))
