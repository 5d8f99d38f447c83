"""nxBP (Lee & Kifer section 3; the papers' "DP-SGD-Vanilla"): one forward and one backward per example.

The oracle: every exact method's clipped sum and norms must equal these (tests/test_exact_methods.py).
Slow by design: B sequential backward passes.
"""
from __future__ import annotations

import torch

from runner.methods.base import METHODS, Method, Privatized, trainable
from runner.norms.certify import certified_norms, upper_sqnorm


@METHODS.register("nxbp")
class NxBP(Method):
    name = "nxbp"
    summary = "one backward per example (exact; the oracle and the papers' DP-SGD-Vanilla)"

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        params = trainable(model)
        sums = [torch.zeros_like(p) for p in params]
        norms, losses, outputs = [], [], []
        for i in range(len(y)):
            with self.autocast(x):
                out = model(x[i:i + 1])  # (1, classes)
                loss = loss_fn(out, y[i:i + 1]).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            # certified: an upper bound of the float32 sum of squares (runner/norms/certify.py), whatever the input
            norm = certified_norms(sum(upper_sqnorm(g.unsqueeze(0))[0] for g in grads), len(grads))
            factor = float(self.clip_factors(norm))
            if factor > 0:  # 0: a non-finite gradient (inf or nan), which must add nothing (no 0 * nan)
                for s, g in zip(sums, grads):
                    s.add_(g, alpha=factor)
            norms.append(norm.detach())
            losses.append(loss.detach())
            outputs.append(out.detach())
        for p, s in zip(params, sums):
            p.grad = s
        return Privatized(torch.stack(losses), torch.cat(outputs), torch.stack(norms))
