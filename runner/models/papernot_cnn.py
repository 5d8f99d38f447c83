"""CIFAR-10 tanh CNNs from Papernot et al. 2020 ("Tempered sigmoid activations"), as used by the JL paper.

All convolutions 3x3, stride 1, 'same' padding (symmetric padding=1 equals TF's 'same' here), tanh, and a 2x2
max-pool after each pair:

    conv 32, 32 -> pool -> conv 64, 64 -> pool -> conv 128, 128 -> pool          (3x32x32 -> 128x4x4)

`papernot_cnn` (JL paper Table 2: "7 convolutional layers and 1 fully-connected layer", 623,146 parameters):
    ... -> conv 3x3 256 ('same', tanh) -> flatten (256*4*4 = 4,096) -> dense 10
  A 4x4 seventh convolution cannot give this count (128*256*16 alone is 524,288 weights; the whole net would
  have 852,522), a 3x3 one gives it exactly: 287,008 (six convs) + 295,168 + 40,970.
`papernot_cnn_fc` (Papernot et al.'s own network, 550,570 parameters):
    ... -> flatten (2,048) -> FC 128 (tanh) -> FC 10        287,008 + 262,272 + 1,290

    MODELS.build("papernot_cnn", info)      # info.input_shape = (3, 32, 32)
"""
from __future__ import annotations

from torch import nn

from runner.memory_format import prefer_channels_last_on_cpu
from runner.models.base import MODELS, flat_size, require_image


def conv_stack(channels: int, widths=(32, 32, "M", 64, 64, "M", 128, 128, "M")) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for w in widths:
        if w == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, int(w), 3, padding=1), nn.Tanh()]
            channels = int(w)
    return layers


@MODELS.register("papernot_cnn")
def build_papernot_cnn(info, last_width: int = 256):
    c, _, _ = require_image(info, "papernot_cnn", min_side=8)
    features = nn.Sequential(*conv_stack(c), nn.Conv2d(128, int(last_width), 3, padding=1), nn.Tanh(), nn.Flatten())
    return prefer_channels_last_on_cpu(  # measured faster channels-last on the CPU (runner/memory_format.py)
        nn.Sequential(features, nn.Linear(flat_size(features, info.input_shape), info.num_classes)))


@MODELS.register("papernot_cnn_fc")
def build_papernot_cnn_fc(info, hidden: int = 128):
    c, _, _ = require_image(info, "papernot_cnn_fc", min_side=8)
    features = nn.Sequential(*conv_stack(c), nn.Flatten())
    return prefer_channels_last_on_cpu(nn.Sequential(  # measured faster channels-last on the CPU
        features, nn.Linear(flat_size(features, info.input_shape), int(hidden)), nn.Tanh(),
        nn.Linear(int(hidden), info.num_classes)))
