"""Lee & Kifer's Transformer classifier: embedding -> sinusoidal positions -> encoder block(s) -> mean-pool -> Linear.

Defaults (L&K section 6.1.1, IMDB): embedding width 200 (learned, or GloVe 6B-200d vectors when `glove_path`
is given), 8 heads, feed-forward 800, dropout 0.1, one post-norm encoder block (torch.nn.TransformerEncoderLayer's
layout; `layers` stacks several), mean over non-padding tokens. Text input is (B, T) int64 ids with 0 = padding;
the vocabulary and T come from the dataset (DataInfo). Images are read as sequences of rows, each row (C*W)
projected to d by a Linear. With vocabulary 8,185: 2,120,002 parameters.

    MODELS.build("transformer", info)                                        # learned embedding
    MODELS.build("transformer", info, glove_path="glove.6B.200d.txt", vocab_path="vocab.txt")
    MODELS.build("transformer", info, layers=12, d_model=768, heads=12, ff=3072, dropout=0.0)   # GPT-2-small-shaped
"""
from __future__ import annotations

import math

import torch
from torch import nn

from runner.errors import DprunError
from runner.models.attention import SelfAttention
from runner.models.base import MODELS
from runner.models.glove import load_glove


class SinusoidalPositions(nn.Module):
    """Adds the fixed sin/cos position code of Vaswani et al.; no parameters."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)  # (L, 1)
        freq = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))  # (d/2,)
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)[:, : d_model // 2]
        self.register_buffer("pe", pe, persistent=False)  # (L, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        return x + self.pe[: x.shape[1]].to(x.dtype)


class EncoderLayer(nn.Module):
    """Post-norm encoder block, the same function as nn.TransformerEncoderLayer(batch_first=True, relu)."""

    def __init__(self, d_model: int, heads: int, ff: int, dropout: float):
        super().__init__()
        self.attn = SelfAttention(d_model, heads, dropout)
        self.linear1 = nn.Linear(d_model, ff)
        self.linear2 = nn.Linear(ff, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.drop_attn, self.drop_ff, self.drop_out = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, T, d)
        x = self.norm1(x + self.drop_attn(self.attn(x, key_padding_mask)))
        ff = self.linear2(self.drop_ff(torch.relu(self.linear1(x))))  # (B, T, d)
        return self.norm2(x + self.drop_out(ff))


class TransformerClassifier(nn.Module):
    def __init__(self, info, d_model: int, heads: int, ff: int, dropout: float, embedding: torch.Tensor | None,
                 freeze_embedding: bool, layers: int):  # defaults: build_transformer below
        super().__init__()
        self.text = info.kind == "text"
        if self.text:
            self.embed = nn.Embedding(info.vocab_size, d_model, padding_idx=0)
            if embedding is not None:
                self.embed.weight.data.copy_(embedding)
            self.embed.weight.requires_grad_(not freeze_embedding)
            max_len = info.input_shape[0]
        else:
            c, h, w = info.input_shape
            self.embed = nn.Linear(c * w, d_model)  # one token per image row
            max_len = h
        self.positions = SinusoidalPositions(d_model, max_len)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, heads, ff, dropout) for _ in range(layers)])
        self.head = nn.Linear(d_model, info.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.text:  # (B, T) int64 ids
            pad = x == 0  # (B, T)
            pad = pad & ~pad.all(1, keepdim=True)  # an all-padding sequence attends to everything (no NaN)
        else:  # (B, C, H, W) -> (B, H, C*W)
            x = x.permute(0, 2, 1, 3).flatten(2)
            pad = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        h = self.drop(self.positions(self.embed(x)))  # (B, T, d)
        for block in self.encoder:
            h = block(h, pad if self.text else None)  # (B, T, d)
        keep = (~pad).unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        pooled = (h * keep).sum(1) / keep.sum(1)  # (B, d): mean over non-padding tokens
        return self.head(pooled)


@MODELS.register("transformer")
def build_transformer(info, d_model: int = 200, heads: int = 8, ff: int = 800, dropout: float = 0.1,
                      glove_path: str | None = None, vocab_path: str | None = None, freeze_embedding: bool = False,
                      layers: int = 1):
    if isinstance(layers, bool) or int(layers) < 1:
        raise DprunError(f"model.layers={layers} must be an integer >= 1 (encoder blocks)")
    embedding = None
    if glove_path:
        if info.kind != "text":
            raise DprunError(f"model.glove_path is for text datasets; {info.name} is {info.kind}; set model.glove_path=null")
        embedding = load_glove(glove_path, vocab_path, info.vocab_size, int(d_model))
    return TransformerClassifier(info, int(d_model), int(heads), int(ff), float(dropout), embedding,
                                 bool(freeze_embedding), int(layers))
