"""memory_format=auto | channels_last | contiguous: the layout of a CNN's activations (issue 31, stops 38-39).

On the CPU, PyTorch's NCHW max-pooling kernel is slow (pytorch/pytorch#51393): bu_cnn's non-private step at B=256
spent 8 of its ~15 ms in max_pool2d_with_indices; the same pooling on channels-last activations takes ~0.9 ms.
Conv weights in channels-last make mkldnn's convolutions return channels-last activations whatever the input's
layout, and ReLU, pooling, GroupNorm and the next convolution keep it up to Flatten (a reshape: it copies into
the logical order, so Linear layers see the same numbers). The step computes the same values in another memory
order: every method's gradients agree with the NCHW step's to float rounding (tests/test_memory_format.py); the
conv norm rule's unfold skips its channels-last copy of the input (the patches are still one copy).

    auto            channels_last on the CPU for a float32/bf16 model that is measured faster there (it carries
                    prefer_channels_last_on_cpu's mark: the zoo's pooling CNNs bu_cnn, cnn, papernot_cnn[_fc]),
                    when the method computes on it correctly; NCHW for a method that needs it; otherwise the
                    model as built (VGG and ResNet: their mkldnn convolutions and GroupNorms lose more in
                    channels-last than their pooling gains; a user's own model: unmeasured; CUDA: the NCHW
                    kernels are not the slow ones, an H200's bk step gained nothing, stop 40; float64: nothing)
    channels_last   asked for: refused in one line for a method that needs NCHW
    contiguous      NCHW, whatever the model was built in

Measured on the 2-core CPU (in-process, interleaved; channels-last step time / NCHW's, non-private and bk): bu_cnn
B=256 ~0.5; L&K's cnn B=16 0.77 / 0.86, B=128 0.65 / 0.76; papernot_cnn B=32 0.82 / 0.84, papernot_cnn_fc 0.80 / 0.84;
VGG-11 B=16 1.14 / 1.05, B=64 1.13 / 1.09 (1.10 without GroupNorm); ResNet-18 B=16 1.03 / 1.05, B=64 1.05 / 1.03
(docs/bench.md, stop 39). Only the models measured faster carry the mark (on this CPU; `make bench-layout` re-reads it).

A method that needs NCHW says so with `channels_last = False`: Opacus 1.6's unfold2d hard-codes row-major strides,
so its per-example conv gradients are wrong on channels-last activations (measured: 0.07-0.3 off on the zoo's
CNNs, hooks and ghost alike); the peer puts the model back in NCHW (runner/methods/opacus_peer.py).

    fmt = choose(model, "auto", method)                  # torch.channels_last | torch.contiguous_format | None
    model.to(memory_format=fmt)                          # (None: nothing) apply() does both: assemble(), the benches
"""
from __future__ import annotations

import torch
from torch import nn

from runner.errors import DprunError

CHOICES = ("auto", "channels_last", "contiguous")
FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
FAST_DTYPES = (torch.float32, torch.bfloat16)  # mkldnn's convolutions; float64 takes slow_conv2d either way


PREFERS_CHANNELS_LAST_ON_CPU = "dprun_prefers_channels_last_on_cpu"  # the module attribute auto reads


def prefer_channels_last_on_cpu(model: nn.Module) -> nn.Module:
    """Mark a model measured faster in channels-last on the CPU (the module docstring's table); returns it."""
    setattr(model, PREFERS_CHANNELS_LAST_ON_CPU, True)
    return model


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def choose(model: nn.Module, setting: str, method, name: str = "memory_format") -> torch.memory_format | None:
    """The layout `setting` means for this model and method (module docstring); None: leave the model as built.
    One line for a bad value or a method that cannot take channels_last. `name`: the caller's word for the knob."""
    setting = str(setting)
    if setting not in CHOICES:
        raise DprunError(f"{name}={setting!r} is not a memory format; choose one of {', '.join(CHOICES)}")
    supports = getattr(method, "channels_last", True)
    if setting == "channels_last" and not supports:
        raise DprunError(f"{name}=channels_last: method={method.name} needs NCHW activations (Opacus's unfold "
                         f"assumes row-major strides: wrong per-example gradients otherwise); use {name}=auto")
    if setting != "auto":
        return FORMATS[setting]
    if not supports:
        return torch.contiguous_format  # whatever the model was built in, the method needs NCHW
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    if (weights and getattr(model, PREFERS_CHANNELS_LAST_ON_CPU, False)
            and all(w.device.type == "cpu" and w.dtype in FAST_DTYPES for w in weights)):
        return torch.channels_last
    # no conv, unmeasured or measured slower (VGG, ResNet, a user's model), a GPU, float64: the model as built (a
    # user's own channels-last model stays so)
    return None


def apply(model: nn.Module, setting: str, method, name: str = "memory_format") -> str:
    """Put the model's 4-D parameters in the layout `setting` chooses, in place (the same Parameter objects: an
    optimizer built on them still holds them); returns the layout it trains in (summary.json's memory_format)."""
    fmt = choose(model, setting, method, name)
    if fmt is not None:
        model.to(memory_format=fmt)
    return describe(model)


def describe(model: nn.Module) -> str:
    """'channels_last' when a conv weight is stored channels-last (and not also NCHW-contiguous), else 'contiguous'."""
    cl = any(m.weight.is_contiguous(memory_format=torch.channels_last) and not m.weight.is_contiguous()
             for m in model.modules() if isinstance(m, nn.Conv2d))
    return "channels_last" if cl else "contiguous"
