"""runner/norms/conv.py unfold (a strided view of the channels-last input, one copy) gives F.unfold's patches, value
for value, in its (kh, kw, c) order per group: for padding (zeros, 'valid', reflect), stride, dilation, groups and
Conv1d. (Stop 34 tried gathering short-run patches by index instead: 1.4 vs 2.7 ms alone, the same 1.7 ms inside
the bk step; not kept.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.norms import conv

CASES = [  # (layer, input shape): C_in = 1, 3, 16, groups, dilation, padding modes
    (nn.Conv2d(1, 16, 8, stride=2), (5, 1, 34, 34)),
    (nn.Conv2d(3, 4, 3, padding=1), (3, 3, 9, 11)),
    (nn.Conv2d(4, 6, 3, stride=(2, 1), dilation=2, groups=2, padding="valid"), (2, 4, 12, 13)),
    (nn.Conv2d(2, 2, (2, 3), padding=2, padding_mode="reflect"), (2, 2, 6, 7)),
    (nn.Conv2d(16, 8, 4, stride=2), (3, 16, 13, 13)),
    (nn.Conv1d(3, 5, 4, stride=3, padding=1), (4, 3, 20)),
]


@pytest.mark.parametrize("layer,shape", CASES, ids=range(len(CASES)))
def test_unfold_equals_f_unfold(layer, shape):
    x = torch.randn(*shape)
    patches = conv.unfold(layer, x)
    # F.unfold's (B, C*kh*kw, L) in (c, kh, kw) order -> (B, L, G, kh*kw*c_g) in (kh, kw, c) order
    x2 = x if x.dim() == 4 else x.unsqueeze(2)
    pads = layer._reversed_padding_repeated_twice
    if x.dim() == 3:
        pads = (*pads, 0, 0)
    x2 = F.pad(x2, pads, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode) if any(pads) else x2
    kernel = layer.kernel_size if x.dim() == 4 else (1, *layer.kernel_size)
    stride = layer.stride if x.dim() == 4 else (1, *layer.stride)
    dilation = layer.dilation if x.dim() == 4 else (1, *layer.dilation)
    ref = F.unfold(x2, kernel, dilation=dilation, stride=stride)  # (B, C*kh*kw, L)
    B, G, C = x.shape[0], layer.groups, x.shape[1]
    ref = ref.view(B, G, C // G, kernel[0] * kernel[1], -1).permute(0, 4, 1, 3, 2).reshape(B, -1, G,
                                                                                         kernel[0] * kernel[1] * (C // G))
    assert torch.equal(patches, ref)

