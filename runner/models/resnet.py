"""ResNet-18/34/50/101 (He et al. 2016) with GroupNorm instead of BatchNorm, for 32x32 and larger images.

torchvision's layout (BasicBlock for 18/34, Bottleneck with stride on the 3x3 conv for 50/101; 1x1 conv +
norm shortcut when the shape changes), global average pooling and one Linear. Stem: `cifar` = 3x3 conv,
stride 1, no max-pool (for 32x32 inputs); `imagenet` = 7x7 conv stride 2 + 3x3 max-pool stride 2; `auto`
picks cifar below 64 pixels and imagenet from 64 (L&K figure 8: LSUN at 64 and 256). GroupNorm has the same
affine parameters as BatchNorm, so counts equal torchvision's: resnet18 on CIFAR-10 11,173,962 (cifar stem),
on 64x64 11,181,642 (imagenet stem).

    MODELS.build("resnet18", info, stem="auto", norm_groups=32)
"""
from __future__ import annotations

from functools import partial

from torch import nn

from runner.errors import DprunError
from runner.models.base import MODELS, group_count, require_image


def norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels)


class Residual(nn.Module):
    """relu(body(x) + shortcut(x)): one residual block."""

    def __init__(self, body: nn.Module, shortcut: nn.Module):
        super().__init__()
        self.body, self.shortcut, self.relu = body, shortcut, nn.ReLU()

    def forward(self, x):  # (B, cin, H, W) -> (B, cout, H/stride, W/stride)
        return self.relu(self.body(x) + self.shortcut(x))


def shortcut(cin: int, cout: int, stride: int, groups: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout, groups))


def basic_block(cin: int, width: int, stride: int, groups: int) -> Residual:  # out channels: width
    return Residual(nn.Sequential(
        nn.Conv2d(cin, width, 3, stride, 1, bias=False), norm(width, groups), nn.ReLU(),
        nn.Conv2d(width, width, 3, 1, 1, bias=False), norm(width, groups)), shortcut(cin, width, stride, groups))


def bottleneck(cin: int, width: int, stride: int, groups: int) -> Residual:  # out channels: 4 * width
    return Residual(nn.Sequential(
        nn.Conv2d(cin, width, 1, bias=False), norm(width, groups), nn.ReLU(),
        nn.Conv2d(width, width, 3, stride, 1, bias=False), norm(width, groups), nn.ReLU(),
        nn.Conv2d(width, 4 * width, 1, bias=False), norm(4 * width, groups)), shortcut(cin, 4 * width, stride, groups))


# name -> (block, out channels per unit of width, blocks per stage)
DEPTHS = {"resnet18": (basic_block, 1, (2, 2, 2, 2)), "resnet34": (basic_block, 1, (3, 4, 6, 3)),
          "resnet50": (bottleneck, 4, (3, 4, 6, 3)), "resnet101": (bottleneck, 4, (3, 4, 23, 3))}
STEMS = ("auto", "cifar", "imagenet")


def resnet(info, name: str, stem: str = "auto", norm_groups: int = 32):
    c, h, w = require_image(info, name, min_side=32)
    if stem not in STEMS:
        raise DprunError(f"unknown model.stem {stem!r}; valid: {', '.join(STEMS)}")
    if stem == "auto":
        stem = "cifar" if min(h, w) < 64 else "imagenet"
    groups = group_count(norm_groups, name)
    layers: list[nn.Module] = (
        [nn.Conv2d(c, 64, 3, 1, 1, bias=False), norm(64, groups), nn.ReLU()] if stem == "cifar" else
        [nn.Conv2d(c, 64, 7, 2, 3, bias=False), norm(64, groups), nn.ReLU(), nn.MaxPool2d(3, 2, 1)])
    block, expansion, counts = DEPTHS[name]
    cin = 64
    for stage, count in enumerate(counts):
        width = 64 * 2 ** stage
        for i in range(count):
            layers.append(block(cin, width, 2 if (i == 0 and stage > 0) else 1, groups))
            cin = width * expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, info.num_classes)]  # (B, cin) -> (B, classes)
    return nn.Sequential(*layers)


for _name in DEPTHS:
    MODELS.register(_name)(partial(resnet, name=_name))
