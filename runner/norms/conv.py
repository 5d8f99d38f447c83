"""nn.Conv1d / nn.Conv2d (L&K 5.2): im2col (a strided view of the padded input), then per group the outer-product
rule over positions.

The unfolded input (B, L, G, kh*kw*C_in/G) is the layer input seen as a sequence of L output positions, so
grad_i W[group] = sum_l g_il a_il^T and the direct/ghost choice of runner/norms/outer.py applies with T = L.
Stride, dilation, zero or string ('same'/'valid') padding, non-zero padding modes and groups are handled;
Conv1d is Conv2d with height 1.

    a, g = ConvRule().sequence(conv, x, grad_out)   # (B, L, G, kh*kw*C_in/G), (B, L, G, C_out/G)

Book-keeping on the CPU (issue 31): where the per-example gradient is kept for the clipped sum, it is formed by
output rows (per_example_by_rows) without the unfolded input, whose (B, L, k) copy can cost more than the products
(bu_cnn's conv1 at B = 256: 2.59 -> 1.97 ms; a 32->32 3x3 conv at 32 px, B = 64: 37.6 -> 14.1 ms; docs/bench.md
"Stop 50"). The kept tensor's own norm is the certificate and the clipped sum adds that very tensor, so how it was
multiplied out does not enter the bound.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner.norms import outer
from runner.norms.base import NormRule, added, register, total, trains
from runner.norms.certify import (add_sqnorm_, finite_rows, kept, gamma, norm_factor, summed_bounds, summed_vector,
                                  unit, upper_sqnorm, vector_norms)


def unfold(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, C_in, *spatial) -> (B, L, G, kh*kw*C_in/G): the patches the layer convolved, per group.

    Patch features are in (kh, kw, c) order, channels innermost (the weight's is (c, kh, kw); clipped_sums
    permutes back). A strided view of the channels-last input and one copy: F.unfold's CPU kernel loops
    over the batch and is ~100x slower, and channels-innermost copies run over contiguous memory."""
    pads = layer._reversed_padding_repeated_twice  # explicit padding, also for 'same' and padding modes
    if any(pads):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        x = F.pad(x, pads, mode=mode)
    if x.dim() == 3:  # Conv1d: (B, C, L) as (B, C, 1, L)
        x = x.unsqueeze(2)
        (kh, kw), (dh, dw), (sh, sw) = (1, *layer.kernel_size), (1, *layer.dilation), (1, *layer.stride)
    else:
        (kh, kw), (dh, dw), (sh, sw) = layer.kernel_size, layer.dilation, layer.stride
    B, C, H, W = x.shape
    G = layer.groups
    x = x.permute(0, 2, 3, 1).contiguous()  # (B, H, W, C)
    oh, ow = (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1
    sB, sH, sW, _ = x.stride()
    view = x.as_strided((B, oh, ow, G, kh, kw, C // G), (sB, sH * sh, sW * sw, C // G, sH * dh, sW * dw, 1))
    return view.reshape(B, oh * ow, G, kh * kw * (C // G))  # (B, L, G, k_g)


# book-keeping forms a kept G_i by rows only where the unfolded input (B x L x k) would exceed this: below it the im2col
# stays in cache and one bmm beats one bmm per output row (per layer: bu_cnn's conv1 at B=128, 6.4 MB, 1.06 vs 1.07
# ms; L&K's conv2 at B=16, 6.3 MB, 1.53 vs 1.66 ms; above it the rows win; docs/bench.md "Stop 50")
ROWS_FLOOR_BYTES = 2**23


def by_rows(layer: nn.Module, inp: torch.Tensor) -> bool:
    """Can per_example_by_rows form this call's per-example gradients: one group, no dilation, a float32/float64
    input on the CPU (on a GPU it would be one small launch per output row; the unfold stays there)."""
    return (layer.groups == 1 and all(d == 1 for d in layer.dilation) and inp.device.type == "cpu"
            and inp.dtype in (torch.float32, torch.float64))


def per_example_by_rows(layer: nn.Module, inp: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """(B, C_out, kh*kw*C_in) per-example weight gradients in unfold's (kh, kw, c) order, for a layer by_rows
    accepts, without the unfolded input.

    Each input row unfolded along the width only, rows: (B, Hp, kw, C_in, ow), kw/sw times the input. Output row i
    read input rows sh*i ... sh*i + kh - 1, which are one contiguous (kh*kw*C_in, ow) block of `rows`, in the
    (kh, kw, c) order: G_b += g_b[:, i, :] (C_out, ow) @ block_b^T (ow, k), one batched product per output row."""
    pads = layer._reversed_padding_repeated_twice
    if any(pads):
        inp = F.pad(inp, pads, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode)
    if inp.dim() == 3:  # Conv1d: (B, C, L) as (B, C, 1, L)
        inp, grad_out = inp.unsqueeze(2), grad_out.unsqueeze(2)
        (kh, kw), (sh, sw) = (1, *layer.kernel_size), (1, *layer.stride)
    else:
        (kh, kw), (sh, sw) = layer.kernel_size, layer.stride
    B, C = inp.shape[:2]
    oh, ow = grad_out.shape[2:]
    rows = inp.unfold(3, kw, sw).permute(0, 2, 4, 1, 3).contiguous()  # (B, Hp, kw, C, ow)
    row, k = kw * C * ow, kh * kw * C  # elements per input row; features per output position
    flat = rows.view(B, -1)
    per_example = torch.empty(B, grad_out.shape[1], k, dtype=inp.dtype, device=inp.device)  # (B, C_out, k)
    for i in range(oh):
        block = flat[:, sh * i * row: (sh * i + kh) * row].view(B, k, ow)  # (B, k, ow), a view
        if i == 0:
            torch.bmm(grad_out[:, :, i, :], block.transpose(1, 2), out=per_example)
        else:
            per_example.baddbmm_(grad_out[:, :, i, :], block.transpose(1, 2))
    return per_example


def weight_order(layer: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """(G, o_g, kh*kw*c_g) in unfold's (kh, kw, c) order -> the layer's weight shape (C_out, c_g, *kernel)."""
    c_g = layer.in_channels // layer.groups
    w = w.reshape(layer.out_channels, *layer.kernel_size, c_g)  # (C_out, *kernel, c_g)
    return w.movedim(-1, 1).contiguous()  # (C_out, c_g, *kernel)


@register(nn.Conv1d, nn.Conv2d)
class ConvRule(NormRule):
    params = ("weight", "bias")

    def sequence(self, layer, inp, grad_out):
        B, G = inp.shape[0], layer.groups
        a = unfold(layer, inp)  # (B, L, G, k_g)
        g = grad_out.reshape(B, G, -1, a.shape[1]).permute(0, 3, 1, 2)  # (B, L, G, o_g), a view
        return a, g

    def norm_sq(self, layer, a, g, how, stash=None):
        B, L, G, k = a.shape
        parts = []
        if trains(layer.weight):  # groups folded into the batch: (B*G, L, k_g), (B*G, L, o_g); views when G = 1
            weight = outer.norm_sq(fold(a), fold(g), how, stash)  # (B*G,)
            parts.append(weight if G == 1 else summed_bounds(weight.view(B, G)))  # G groups' bounds added
        if trains(layer.bias):  # per-example bias grad sum_l g_l (B, G*o_g), certified (runner/norms/certify.py)
            sums = g.sum(1).reshape(B, -1)  # (B, C_out)
            if stash is not None and parts:  # book-keeping adds these very sums (one (1, B) x (B, C_out) product);
                stash["bias"] = sums  # their bound added to the weight's in one kernel
                parts[0] = add_sqnorm_(parts[0], sums)
            elif stash is not None:
                stash["bias"] = sums
                parts.append(upper_sqnorm(sums))
            else:
                mass = vector_norms(g, (2, 3)).sum(1).mul_(
                    norm_factor(G * g.shape[3], unit(g)) * (1 + gamma(L + 2, unit(g))))
                parts.append(summed_vector(sums, mass, L))
        return total(parts, a)

    def records_norm_sq(self, layer, inp, grad_out, how, stash=None):
        """norm_sq from one call's records where book-keeping keeps the per-example gradient and by_rows applies:
        formed by per_example_by_rows and kept with the bias's per-example sums (B, C_out); the bound is their own
        norm, as on norm_sq's kept route (the clipped sums add these very tensors). None elsewhere (sequence, then
        norm_sq)."""
        if stash is None or not trains(layer.weight) or not by_rows(layer, inp):
            return None
        B, o, T = grad_out.shape[0], grad_out.shape[1], grad_out[0, 0].numel()
        k = layer.weight[0].numel()
        # the keep rule last: a method.keep_mb budget counts what it admits, and norm_sq asks again on a None
        if T == 1 or outer.use_ghost(T, k, o, how, stash=True) or B * T * k * inp.element_size() <= ROWS_FLOOR_BYTES \
                or not outer.stash_keeps(stash, B, T, k, o, inp.element_size()):
            return None
        per_example = per_example_by_rows(layer, inp, grad_out)  # (B, C_out, k)
        stash["weight"] = per_example
        value = upper_sqnorm(per_example)  # (B,)
        if trains(layer.bias):
            sums = grad_out.flatten(2).sum(2)  # (B, C_out): sum over positions, the per-example bias gradient
            stash["bias"] = sums
            value = add_sqnorm_(value, sums)
        return value

    def stash_only(self, layer, stash):
        """Book-keeping kept G_i and the bias's per-example sums, so the records are freed inside the backward, not
        held to the clipped sums; unless the lean recorder defers the norms of record-keeping layers (method.defer on
        or all, and auto on a GPU): a conv keeps its records then and its norm follows the backward, with no hook
        (runner/norms/lean.py: a host-bound GPU step's launch order, stop 44)."""
        return (not getattr(stash, "defers", False) and "weight" in stash
                and all(name in stash for name in self.params if trains(getattr(layer, name))))

    def clipped_sums(self, layer, a, g, nu, stash=None):
        sums: dict[str, torch.Tensor] = {}
        B, L, G, k = a.shape
        if trains(layer.weight) and stash is not None and "weight" in stash:  # per-example (B*G, o_g, k_g) kept
            per_example = finite_rows(stash.pop("weight").view(B, G, -1, k), kept(nu))
            sums["weight"] = weight_order(layer, torch.einsum("b,bgok->gok", nu, per_example))
        elif trains(layer.weight):
            weighted = finite_rows(g * nu.view(-1, 1, 1, 1), kept(nu))  # (B, L, G, o_g)
            sums["weight"] = weight_order(layer, torch.einsum("blgo,blgk->gok", weighted, finite_rows(a, kept(nu))))
        if trains(layer.bias):
            sums["bias"] = bias_sum(g, nu, stash)
        return sums


def bias_sum(g: torch.Tensor, nu: torch.Tensor, stash: dict | None) -> torch.Tensor:
    """(C_out,) sum_i nu_i sum_l g_il: from the per-example sums book-keeping kept (B, C_out), else from g (B, L, G, o_g)."""
    stashed = stash.pop("bias", None) if stash is not None else None
    per_example = stashed if stashed is not None else g.sum(1).reshape(len(nu), -1)
    return nu.unsqueeze(0).mm(finite_rows(per_example, kept(nu))).squeeze(0)


def weight_grad(layer: nn.Module, inp: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """sum over the batch of the conv weight gradient, by the convolution's own weight-backward kernel (no unfold)."""
    pads = layer._reversed_padding_repeated_twice
    if any(pads):
        inp = F.pad(inp, pads, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode)
    zeros = [0] * (inp.dim() - 2)
    _, gw, _ = torch.ops.aten.convolution_backward(
        grad_out, inp, layer.weight, None, list(layer.stride), zeros, list(layer.dilation), False, zeros,
        layer.groups, [False, True, False])
    return gw


def weighted_weight_grad(layer: nn.Module, inp: torch.Tensor, grad: torch.Tensor, nu: torch.Tensor,
                         keep: torch.Tensor) -> torch.Tensor:
    """sum_i nu_i (the weight gradient of example i) by the weight-gradient kernel, the smaller of the input
    (B, C_in, *spatial) and the output-gradient (B, C_out, *spatial) weighted: one copy of that one (memory: the
    copy of a first conv's output-gradient was the peak of recompute's clipped sums). Rows not kept are zeroed in
    both (no 0 * inf)."""
    shape = (-1,) + (1,) * (grad.dim() - 1)
    if inp.numel() <= grad.numel():
        return weight_grad(layer, finite_rows(inp * nu.view(shape), keep), finite_rows(grad, keep))
    return weight_grad(layer, finite_rows(inp, keep), finite_rows(grad * nu.view(shape), keep))


def _clipped_sums_calls(self, layer, calls, nu, stash=None):
    """Memory: clipped sums from the raw (input, output-gradient) calls, never the unfolded input: the weight's
    from a kept per-example gradient when there is one, else by the conv weight-gradient kernel with the nu weights
    on the smaller of input and output-gradient (the non-private backward's own kernel); the bias's from the
    per-example sums the norm step kept, else from the output-gradient's. A record with nu = 0 (a non-finite norm)
    adds nothing: its rows are zeroed first (no 0 * inf)."""
    sums: dict[str, torch.Tensor] = {}
    B, G = nu.shape[0], layer.groups
    keep = kept(nu)
    stash = stash if stash is not None else {}
    if trains(layer.weight) and "weight" in stash:  # per-example (B*G, o_g, k_g) kept
        per_example = stash.pop("weight")
        per_example = finite_rows(per_example.view(B, G, *per_example.shape[1:]), keep)
        sums["weight"] = weight_order(layer, torch.einsum("b,bgok->gok", nu, per_example))
    elif trains(layer.weight):
        sums["weight"] = added(weighted_weight_grad(layer, inp, grad, nu, keep) for inp, grad in calls)
    if trains(layer.bias):
        # the per-example sums (B, C_out): book-keeping's kept ones, else each call's over its positions, added
        per_example = stash.pop("bias", None)
        if per_example is None:
            per_example = added(grad.sum(list(range(2, grad.dim()))) for _, grad in calls)
        sums["bias"] = nu.unsqueeze(0).mm(finite_rows(per_example, keep)).squeeze(0)
    return sums


ConvRule.clipped_sums_calls = _clipped_sums_calls


def fold(t: torch.Tensor) -> torch.Tensor:
    """(B, L, G, c) -> (B*G, L, c): each (example, group) pair as one example of the outer-product rule."""
    B, L, G, c = t.shape
    return t.permute(0, 2, 1, 3).reshape(B * G, L, c)
