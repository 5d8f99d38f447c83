"""The model registry and the input checks shared by the model families.

    @MODELS.register("cnn")
    def build_cnn(info, **kw): require_image(info, "cnn"); ...
"""
import torch

from runner.errors import DprunError
from runner.registry import Registry

MODELS = Registry("model")


def require_image(info, model: str, min_side: int = 1) -> tuple[int, int, int]:
    """(C, H, W) of an image dataset, or a one-line DprunError naming the dataset and what the model accepts."""
    if info.kind != "image" or len(info.input_shape) != 3:
        raise DprunError(f"model={model} needs images (C, H, W) but dataset {info.name} gives {info.kind} "
                         f"of shape {tuple(info.input_shape)}; for text use model=bilstm, transformer, rnn, lstm or gru")
    c, h, w = info.input_shape
    if min(h, w) < min_side:
        raise DprunError(f"model={model} needs images of at least {min_side}x{min_side}; dataset {info.name} "
                         f"gives {h}x{w}")
    return c, h, w


def flat_size(features, input_shape) -> int:
    """Features per example after `features`, found by one forward pass of a zero image (1, *input_shape)."""
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).numel()


def group_count(groups, model: str) -> int:
    """GroupNorm groups for the VGG/ResNet channel counts (all multiples of 64): a divisor of 64."""
    valid = (1, 2, 4, 8, 16, 32, 64)
    if int(groups) not in valid:
        raise DprunError(f"model.norm_groups={groups} does not divide the channels of {model}; "
                         f"valid: {', '.join(map(str, valid))}")
    return int(groups)
