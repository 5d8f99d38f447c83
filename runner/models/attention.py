"""Multi-head self-attention from four explicit nn.Linear projections (q, k, v, out), so per-layer norm rules apply.

Same function as torch.nn.MultiheadAttention(d, heads, batch_first=True) used as self-attention, whose fused
`in_proj_weight` is the concatenation [q.weight; k.weight; v.weight].

    attn = SelfAttention(d_model=200, heads=8)
    y = attn(x, key_padding_mask=(tokens == 0))     # (B, T, d) -> (B, T, d); True marks padding keys

Without dropout on the attention weights (eval mode, or dropout 0) the scores go through
F.scaled_dot_product_attention: the same function, one fused kernel that keeps no (B, H, T, T) softmax for the
backward (CPU, bench transformer B=32: every method's step faster and leaner, docs/bench.md "Stop 49"). Its fused
CPU kernel has no forward-mode or double-backward formula and no vmap rule: jl and multiloss run under
`composite_attention()`, which selects SDPA's math backend (plain differentiable operators). With dropout the
written-out softmax (softmax_attention) draws the mask, as before, from torch's global generator (jl and reweight replay it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


def composite_attention():
    """Context in which F.scaled_dot_product_attention runs as plain differentiable operators (its math backend):
    forward-mode AD (jl's jvp), double backward (jl's double_vjp) and vmap (multiloss) need it; the fused kernels
    have no formula for them. Also a user's own model that calls SDPA."""
    return sdpa_kernel([SDPBackend.MATH])


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
        if self.training and self.dropout.p > 0:
            heads = softmax_attention(q, k, v, key_padding_mask, self.dropout)
        else:
            heads = fused_attention(q, k, v, key_padding_mask)
        return self.out(heads.transpose(1, 2).reshape(B, T, d))  # (B, T, d)


def fused_attention(q, k, v, key_padding_mask=None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h)) v with padding keys masked, by F.scaled_dot_product_attention: q, k, v (B, H, T,
    d_h) -> (B, H, T, d_h). Autocast is off around it: q, k, v are already in autocast's dtype (the Linears'
    outputs), and under vmap (multiloss) autocast's cast of SDPA's math backend fails ("expected scalar type
    BFloat16 but found Float", torch 2.13)."""
    keep = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T), True = attend
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def softmax_attention(q, k, v, key_padding_mask=None, dropout: nn.Module | None = None) -> torch.Tensor:
    """The same function written out, with dropout on the attention weights (B, H, T, T): the mask is drawn from
    torch's global generator, which jl and reweight replay."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))  # mask keys (B,1,1,T)
    weights = torch.softmax(scores, -1)
    return (dropout(weights) if dropout is not None else weights) @ v  # (B, H, T, d_h)
