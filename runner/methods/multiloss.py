"""multiLoss (Lee & Kifer section 3): every per-example gradient at once, materialised, then clipped and summed.

The "ask autodiff for the gradient of the vector of losses" baseline, written with torch.func:
`vmap(grad(loss of one example))` over the batch gives, for every trainable parameter p, a tensor
(B, *p.shape) of per-example gradients in one call. Norms, clip factors and the weighted sum follow.
Works on any model vmap can trace (a Linear called T times by a recurrent cell is just part of the function,
so its per-example gradient is already the sum over calls). Honest about memory: B full copies of the model's
gradient are alive at once; `method.chunk=K` bounds that to K copies (K examples per vmap call).

    dprun method=multiloss dataset=mnist model=cnn
    dprun method=multiloss method.chunk=64           # very large B: 64 examples per vmap call

Randomness (dropout) under vmap uses randomness="different": each example draws its own mask, as it would in
nxBP's one-example-at-a-time forward passes (the masks are not the same draws as nxBP's, so compare in eval
mode or with dropout 0).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.overrides import TorchFunctionMode

from runner.errors import DprunError
from runner.norms.certify import certified_norms, finite_rows, upper_sqnorm
from runner.methods.base import METHODS, Method, Privatized
from runner.models.attention import composite_attention


class _Float32LayerNorm(TorchFunctionMode):
    """F.layer_norm on a float32 copy of a bf16 or fp16 input, as CUDA's autocast does by itself. CPU autocast
    leaves layer_norm to run on the bfloat16 output of a Linear with float32 weights, whose backward under vmap
    fails in torch 2.13 ("expected scalar type BFloat16 but found Float": multiloss with precision=bf16 on any model
    with a LayerNorm after a Linear). The norms and the clipped sum are formed from the gradients vmap returns, so
    the bound holds whatever the forward's precision."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.layer_norm and args and args[0].dtype in (torch.bfloat16, torch.float16):
            args = (args[0].float(), *args[1:])
        return func(*args, **kwargs)


def float32_layer_norm(on: bool):
    """_Float32LayerNorm where `on` (precision=bf16), else nothing."""
    return _Float32LayerNorm() if on else contextlib.nullcontext()


@METHODS.register("multiloss")
class MultiLoss(Method):
    name = "multiloss"
    summary = "all per-example gradients at once with torch.func vmap(grad) (exact; memory ~ B x model)"

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        trainable = {n: params[n].detach() for n in names}
        # frozen parameters and buffers enter functional_call unchanged
        fixed = {n: p.detach() for n, p in params.items() if n not in trainable}
        fixed.update(dict(model.named_buffers()))

        def loss_one(theta, xi, yi):  # one example: xi (*input_shape), yi ()
            with self.autocast(xi), float32_layer_norm(self.precision == "bf16"):
                out = functional_call(model, (theta, fixed), (xi.unsqueeze(0),))  # (1, classes)
                loss = loss_fn(out, yi.unsqueeze(0)).sum()
            return loss, (loss.detach(), out.detach().squeeze(0))

        per_example = vmap(grad(loss_one, has_aux=True), in_dims=(None, 0, 0), randomness="different")
        sums = {n: torch.zeros_like(t) for n, t in trainable.items()}
        norms, losses, outputs = [], [], []
        chunk = int(self.option("chunk", 0)) or max(1, len(y))
        if chunk < 0:
            raise DprunError(f"method.chunk={chunk} must be >= 0 (0 = the whole batch in one vmap call)")
        for start in range(0, len(y), chunk):
            xs, ys = x[start:start + chunk], y[start:start + chunk]
            try:
                with composite_attention():  # vmap through SDPA (runner/models/attention.py)
                    grads, (loss, out) = per_example(trainable, xs, ys)  # grads[n]: (b, *p.shape)
            except RuntimeError as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DprunError(f"method=multiloss: torch.func.vmap cannot trace {type(model).__name__}: {msg}; "
                                 f"try method=nxbp") from e
            norm = certified_norms(sum(upper_sqnorm(g) for g in grads.values()), len(grads))  # (b,) certified (norms/certify.py)
            factor = self.clip_factors(norm)  # (b,); 0 for a non-finite gradient, whose rows are zeroed
            for n, g in grads.items():
                g = finite_rows(g, factor > 0)
                sums[n].add_(torch.tensordot(factor.to(g.dtype), g, dims=1))  # sum_i f_i g_i: p.shape
            del grads
            norms.append(norm)
            losses.append(loss)
            outputs.append(out)
        for n in names:
            params[n].grad = sums[n]
        return Privatized(torch.cat(losses), torch.cat(outputs), torch.cat(norms))
