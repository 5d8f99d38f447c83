"""Recurrent classifiers: Lee & Kifer's `rnn`, `lstm`, `gru` and the JL paper's IMDB `bilstm`.

Images (B, C, H, W) are read as sequences of H rows of C*W values (L&K: row i is time step i); text (B, T) ids
go through an Embedding first. One recurrent layer (runner/models/recurrent.py: unfused, nn.Linear only), its
last hidden state (both directions concatenated when bidirectional), optional Dense+ReLU, then a Linear.

    MODELS.build("rnn", mnist_info)    # tanh RNN(128) + Linear: 21,514 parameters on MNIST
    MODELS.build("bilstm", imdb_info)  # Embedding(8185, 64) -> BiLSTM(64) -> Dense(64, ReLU) -> Dense(2): 598,274

`init="keras"` gives TF Keras's initialisers (the JL paper's model was Keras): embedding U(-0.05, 0.05), Glorot-uniform
input and Dense kernels, orthogonal recurrent kernels, zero biases, forget-gate bias 1; `init="torch"` keeps
PyTorch's. `mask_padding=True` (text only) makes padding (id 0) steps keep the recurrent state (Keras mask_zero).
"""
from __future__ import annotations

import torch
from torch import nn

from runner.models.base import MODELS
from runner.models.recurrent import LAYERS


INITS = ("torch", "keras")


class RecurrentClassifier(nn.Module):
    def __init__(self, info, cell: str, hidden: int, embed_dim: int, bidirectional: bool, double_bias: bool,
                 dense: int, init: str, mask_padding: bool):  # defaults: the builders registered below
        super().__init__()
        if init not in INITS:
            raise ValueError(f"model.init={init!r} is not one of {', '.join(INITS)}")
        self.text = info.kind == "text"
        if mask_padding and not self.text:
            raise ValueError(f"model.mask_padding=true needs a text dataset (token id 0 = padding); "
                             f"{info.name} is {info.kind}")
        self.mask_padding = bool(mask_padding)
        if self.text:
            self.embed = nn.Embedding(info.vocab_size, embed_dim)
            in_size = embed_dim
        else:
            c, _, w = info.input_shape
            in_size = c * w
        self.recurrent = LAYERS[cell](in_size, hidden, bidirectional=bidirectional, double_bias=double_bias)
        width = hidden * (2 if bidirectional else 1)
        head: list[nn.Module] = [nn.Linear(width, dense), nn.ReLU()] if dense else []
        self.head = nn.Sequential(*head, nn.Linear(dense or width, info.num_classes))
        if init == "keras":
            self.keras_init_()

    def keras_init_(self) -> None:
        if self.text:
            nn.init.uniform_(self.embed.weight, -0.05, 0.05)
        self.recurrent.keras_init_()
        for layer in self.head:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = None
        if self.text:
            mask = (x != 0) if self.mask_padding else None  # (B, T): True at real tokens
            x = self.embed(x)  # (B, T) -> (B, T, e)
        else:
            x = x.permute(0, 2, 1, 3).flatten(2)  # (B, C, H, W) -> (B, H, C*W): rows as time steps
        return self.head(self.recurrent(x, mask))  # (B, dirs*h) -> (B, classes)


def register(name: str, cell: str, hidden: int, bidirectional: bool, double_bias: bool, dense: int,
             init: str = "torch"):
    def build(info, hidden: int = hidden, embed_dim: int = 64, bidirectional: bool = bidirectional,
              double_bias: bool = double_bias, dense: int = dense, init: str = init, mask_padding: bool = False):
        return RecurrentClassifier(info, cell, int(hidden), int(embed_dim), bool(bidirectional), bool(double_bias),
                                   int(dense), str(init), bool(mask_padding))

    MODELS.register(name)(build)


# Lee & Kifer: one layer of 128 + Linear, PyTorch-style double bias
register("rnn", "rnn", hidden=128, bidirectional=False, double_bias=True, dense=0)
register("lstm", "lstm", hidden=128, bidirectional=False, double_bias=True, dense=0)
register("gru", "gru", hidden=128, bidirectional=False, double_bias=True, dense=0)
# JL paper (TF Keras): bidirectional LSTM(64) with Keras's single bias and initialisers, Dense(64, ReLU), Dense(classes)
register("bilstm", "lstm", hidden=64, bidirectional=True, double_bias=False, dense=64, init="keras")
