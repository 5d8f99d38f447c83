"""Unfused recurrent layers (tanh RNN, LSTM, GRU) built only from nn.Linear, so per-layer norm rules apply.

Contract with the per-layer norm rules (runner/norms/): each direction has two Linears,

    x_proj = nn.Linear(input_size, G*h, bias=True)      applied ONCE to the whole sequence (B, T, in) -> (B, T, G*h)
    h_proj = nn.Linear(h, G*h, bias=double_bias)        called ONCE PER TIME STEP on (B, h): T calls per forward

with G = 1 (RNN), 4 (LSTM, gates i, f, g, o) or 3 (GRU, gates r, z, n), the gate order of torch.nn.LSTM/GRU.
`bidirectional=True` adds `x_proj_reverse` / `h_proj_reverse` for the reverse direction. `double_bias=True`
matches PyTorch (b_ih and b_hh); `double_bias=False` matches Keras (one bias per gate, in x_proj).

    lstm = LSTMLayer(28, 128, bidirectional=True)
    out = lstm(x)                        # (B, T, 28) -> (B, 2*128): last hidden state of each direction
    seq = LSTMLayer(28, 128, return_sequences=True)(x)   # (B, T, 128): every step's hidden state

The last hidden state is torch's h_n: the forward direction after step T-1, the reverse direction after step 0.
With a mask (B, T) (True = real token), a masked step keeps the state, h_t = m_t * cell(x_t, h_{t-1}) +
(1 - m_t) * h_{t-1} (Keras `mask_zero=True`), so each direction's last state is the one at its last real token.
"""
from __future__ import annotations

import torch
from torch import nn


class RecurrentLayer(nn.Module):
    """One recurrent layer over a (B, T, input_size) sequence.

    Subclasses set `gates` (G) and define `cell(gx, h, c, h_proj) -> (h, c)`: one step from the input projection
    gx (B, G*h) and the state h, c (B, h); c is the LSTM cell state and passes through RNN/GRU unchanged."""

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, bidirectional: bool = False, double_bias: bool = True,
                 return_sequences: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.bidirectional = bidirectional
        self.return_sequences = return_sequences
        width = self.gates * hidden_size
        self.x_proj = nn.Linear(input_size, width, bias=True)
        self.h_proj = nn.Linear(hidden_size, width, bias=double_bias)
        if bidirectional:
            self.x_proj_reverse = nn.Linear(input_size, width, bias=True)
            self.h_proj_reverse = nn.Linear(hidden_size, width, bias=double_bias)
        # PyTorch's recurrent init: U(-1/sqrt(h), 1/sqrt(h)) for every weight and bias
        bound = hidden_size ** -0.5
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def keras_init_(self) -> None:
        """TF Keras's LSTM/GRU/SimpleRNN defaults: Glorot-uniform input kernels, orthogonal recurrent kernels, zero
        biases, and (LSTM, unit_forget_bias) a forget-gate bias of 1 in the gate bias that Keras has (x_proj's)."""
        h = self.hidden_size
        for suffix in ("", "_reverse") if self.bidirectional else ("",):
            x_proj, h_proj = getattr(self, "x_proj" + suffix), getattr(self, "h_proj" + suffix)
            nn.init.xavier_uniform_(x_proj.weight)  # (G*h, in): Keras's (in, G*h) kernel, same fans
            nn.init.orthogonal_(h_proj.weight)      # (G*h, h): orthonormal columns, Keras's (h, G*h) transposed
            nn.init.zeros_(x_proj.bias)
            if h_proj.bias is not None:
                nn.init.zeros_(h_proj.bias)
            if self.gates == 4:
                with torch.no_grad():
                    x_proj.bias[h:2 * h] = 1.0  # gate order (i, f, g, o): f is the second block

    def run(self, x: torch.Tensor, x_proj: nn.Linear, h_proj: nn.Linear, reverse: bool,
            mask: torch.Tensor | None = None):
        gx = x_proj(x)  # (B, T, G*h): one call for the whole sequence
        B, T, _ = x.shape
        h = x.new_zeros(B, self.hidden_size)  # (B, h)
        c = x.new_zeros(B, self.hidden_size)  # (B, h) LSTM cell state; unused by RNN/GRU
        # unbind, not gx[:, t]: each select's backward zero-fills a whole (B, T, G*h) gradient, O(T^2) work in all
        # (6.5 s of a 6.7 s bilstm step on IMDB, B=256, T=150, CPU); unbind's backward stacks once.
        gx_steps = gx.unbind(1)  # T tensors (B, G*h)
        keep = None if mask is None else mask.to(x.dtype).unsqueeze(-1).unbind(1)  # T tensors (B, 1), 1 = real
        outputs = [None] * T
        for t in (range(T - 1, -1, -1) if reverse else range(T)):
            h_new, c_new = self.cell(gx_steps[t], h, c, h_proj)  # h_proj is called here, once per step
            if keep is None:
                h, c = h_new, c_new
            else:  # a padded step leaves the state as it was
                h = keep[t] * h_new + (1 - keep[t]) * h
                c = keep[t] * c_new + (1 - keep[t]) * c
            outputs[t] = h
        return torch.stack(outputs, 1), h  # (B, T, h), (B, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, T, in), (B, T)
        seq, last = self.run(x, self.x_proj, self.h_proj, reverse=False, mask=mask)
        if self.bidirectional:
            seq_r, last_r = self.run(x, self.x_proj_reverse, self.h_proj_reverse, reverse=True, mask=mask)
            seq, last = torch.cat([seq, seq_r], -1), torch.cat([last, last_r], -1)
        return seq if self.return_sequences else last  # (B, T, dirs*h) or (B, dirs*h)


class RNNLayer(RecurrentLayer):
    """Elman RNN: h' = tanh(W_x x + b_x + W_h h + b_h)."""

    gates = 1

    def cell(self, gx, h, c, h_proj):
        return torch.tanh(gx + h_proj(h)), c


class LSTMLayer(RecurrentLayer):
    """LSTM with torch.nn.LSTM's equations and gate order (i, f, g, o)."""

    gates = 4

    def cell(self, gx, h, c, h_proj):
        i, f, g, o = (gx + h_proj(h)).chunk(4, -1)  # each (B, h)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class GRULayer(RecurrentLayer):
    """GRU with torch.nn.GRU's equations: the reset gate multiplies (W_hn h + b_hn), gate order (r, z, n)."""

    gates = 3

    def cell(self, gx, h, c, h_proj):
        xr, xz, xn = gx.chunk(3, -1)  # each (B, h)
        hr, hz, hn = h_proj(h).chunk(3, -1)  # each (B, h)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, c


LAYERS = {"rnn": RNNLayer, "lstm": LSTMLayer, "gru": GRULayer}
