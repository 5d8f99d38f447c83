"""VGG-11/13/16 (Simonyan & Zisserman 2015) with GroupNorm after each convolution instead of BatchNorm.

Convolutions 3x3 'same' + GroupNorm + ReLU, five 2x2 max-pools (so images must be at least 32x32), then an
adaptive average pool to `pool_size` x `pool_size` (so 32, 64 and 256-pixel inputs all work) and the
classifier: FC `fc_width` -> ReLU -> FC `fc_width` -> ReLU -> FC classes (`fc_width: 0` = one Linear).
On CIFAR-10 with the defaults (pool 1, fc 4096): vgg11 28,149,514, vgg13 28,334,410, vgg16 33,646,666
parameters. `pool_size=7` gives torchvision's classifier (L&K figure 8 on LSUN); `norm_groups=0` the original
un-normalised VGG.

    MODELS.build("vgg13", info, fc_width=512)
"""
from __future__ import annotations

from functools import partial

from torch import nn

from runner.models.base import MODELS, group_count, require_image

CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


def vgg(info, name: str, pool_size: int = 1, fc_width: int = 4096, norm_groups: int = 32, dropout: float = 0.0):
    c, _, _ = require_image(info, name, min_side=32)
    groups = group_count(norm_groups, name) if norm_groups else 0
    layers: list[nn.Module] = []
    for v in CONFIGS[name]:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        layers.append(nn.Conv2d(c, v, 3, padding=1))
        if groups:
            layers.append(nn.GroupNorm(groups, v))
        layers.append(nn.ReLU())
        c = v
    layers += [nn.AdaptiveAvgPool2d(int(pool_size)), nn.Flatten()]  # (B, 512 * pool^2)
    width = c * int(pool_size) ** 2
    for _ in range(2 if fc_width else 0):
        layers += [nn.Linear(width, int(fc_width)), nn.ReLU(), nn.Dropout(float(dropout))]
        width = int(fc_width)
    layers.append(nn.Linear(width, info.num_classes))
    return nn.Sequential(*layers)


for _name in CONFIGS:
    MODELS.register(_name)(partial(vgg, name=_name))
