"""nn.Linear (L&K 5.1, 5.3, 5.4, 5.6): inputs (B, in) or sequences (B, ..., in); grad_i W = sum_t g_it a_it^T.

Recurrent cells (runner/models/recurrent.py: h_proj called once per time step) and attention projections
(runner/models/attention.py) are plain Linears: the hooks stack a module's calls along T, so the same rule
gives the per-example gradient summed over time steps, then its norm.

    a, g = LinearRule().sequence(lin, x, grad_out)     # (B, T, in), (B, T, out); T = 1 for 2D inputs
"""
from __future__ import annotations

import torch
from torch import nn

from runner.norms import outer
from runner.norms.base import NormRule, added, register, total, trains
from runner.norms.certify import finite_rows, kept
from runner.norms.tensor_cores import to_float32


@register(nn.Linear)
class LinearRule(NormRule):
    params = ("weight", "bias")
    sequence_is_call = True  # (B, T, in), (B, T, out): a call on a sequence
    tensor_cores = True  # bf16 records on a GPU stay bf16 (runner/norms/tensor_cores.py)

    def sequence(self, layer, inp, grad_out):
        B = inp.shape[0]
        return inp.reshape(B, -1, layer.in_features), grad_out.reshape(B, -1, layer.out_features)

    def norm_sq(self, layer, a, g, how, stash=None):
        if a.shape[1] == 1 and a.dtype == g.dtype and a.dtype in (torch.float32, torch.float64) \
                and trains(layer.weight) and trains(layer.bias):  # one position: one bound for weight and bias
            return outer.rank_one_with_bias_sq(a, g, stash)
        parts = []
        if trains(layer.weight):
            parts.append(outer.norm_sq(a, g, how, stash))
        if trains(layer.bias) and parts and stash is not None:  # book-keeping: the bias's bound added in one kernel
            return outer.with_bias_norm_sq(parts[0], to_float32(g), stash)
        if trains(layer.bias):
            parts.append(outer.bias_norm_sq(to_float32(g), stash))  # (N, T, o) float32: a bias sum is cheap
        return total(parts, a)

    def stash_only(self, layer, stash):
        """Book-keeping kept G_i (the weight, when `keeps`) and the bias's per-example sums: nothing else needed."""
        return all(name in stash for name in self.params if trains(getattr(layer, name)))

    def clipped_sums_calls(self, layer, calls, nu, stash=None):
        """Book-keeping: the weight's clipped sum as one GEMM per recorded call, added, never the calls concatenated
        along T (a recurrent cell's 28 calls: no (B, 28, in) + (B, 28, out) copy, issue 31); the rest as usual."""
        if len(calls) <= 1 or not trains(layer.weight) or (stash and "weight" in stash):
            return super().clipped_sums_calls(layer, calls, nu, stash)
        sums: dict[str, torch.Tensor] = {}
        keep = kept(nu)  # a record with nu = 0 (non-finite norm) adds nothing (its rows zeroed: no 0 * inf)
        for inp, grad in calls:
            a, g = self.sequence(layer, inp, grad)  # views: (B, T_c, in), (B, T_c, out)
            part = outer.clipped_sum(a, g, nu)  # (out, in)
            sums["weight"] = part if "weight" not in sums else sums["weight"].add_(part)
        if trains(layer.bias):
            stashed = stash.pop("bias", None) if stash else None
            per_example = stashed if stashed is not None else added(
                to_float32(grad).reshape(len(nu), -1, layer.out_features).sum(1) for _, grad in calls)  # (B, out)
            sums["bias"] = nu.unsqueeze(0).mm(finite_rows(per_example, keep)).squeeze(0)
        return sums

    def clipped_sums(self, layer, a, g, nu, stash=None):
        sums: dict[str, torch.Tensor] = {}
        if trains(layer.weight):
            sums["weight"] = outer.clipped_sum(a, g, nu, stash)  # (out, in)
        if trains(layer.bias):
            sums["bias"] = outer.bias_clipped_sum(to_float32(g), nu, stash)  # (out,)
        return sums
