"""Multi-head self-attention from four explicit nn.Linear projections (q, k, v, out), so per-layer norm rules apply.

Same function as torch.nn.MultiheadAttention(d, heads, batch_first=True) used as self-attention, whose fused
`in_proj_weight` is the concatenation [q.weight; k.weight; v.weight].

    attn = SelfAttention(d_model=200, heads=8)
    y = attn(x, key_padding_mask=(tokens == 0))     # (B, T, d) -> (B, T, d); True marks padding keys
"""
from __future__ import annotations

import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)  # on the attention weights, as in nn.MultiheadAttention
        # nn.MultiheadAttention's init: Xavier-uniform projections of the fused (3d, d) matrix, zero biases
        bound = math.sqrt(6.0 / (d_model + 3 * d_model))
        for lin in (self.q, self.k, self.v):
            nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, d = x.shape
        split = lambda z: z.view(B, T, self.heads, d // self.heads).transpose(1, 2)  # (B, H, T, d/H)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)  # (B, H, T, T)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))  # mask keys (B,1,1,T)
        weights = self.dropout(torch.softmax(scores, -1))  # (B, H, T, T)
        heads = (weights @ v).transpose(1, 2).reshape(B, T, d)  # (B, T, d)
        return self.out(heads)
