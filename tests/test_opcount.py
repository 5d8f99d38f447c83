"""runner/bench/opcount.py: operators per step, the device-independent proxy for a host-bound GPU step's launches."""
from __future__ import annotations

import torch

from runner.bench.opcount import kernels, op_counts


def test_kernels_count_computing_operators_and_not_views():
    x, w = torch.randn(4, 6), torch.randn(6, 3)

    def step():
        y = x.view(2, 12).t()  # views: no kernel
        y = y.reshape(4, 6)  # of a transposed tensor: a copy (clone), one kernel
        z = (y @ w).relu_()  # mm, relu_
        return z.sum()  # sum

    assert kernels(step) == 4
    ops = op_counts(step)
    # the profiler's leaves hold the CPU's own pieces (an mm's resolve_conj, the views' as_strided ...): more
    assert ops["leaf_ops"] > 4 and ops["aten_ops"] >= ops["leaf_ops"]


def test_kernels_see_the_backward_and_run_before_first():
    lin = torch.nn.Linear(5, 2)
    x = torch.randn(3, 5)
    calls = []

    def step():
        lin(x).sum().backward()

    def before():
        calls.append(1)
        lin.zero_grad(set_to_none=True)

    forward_and_backward = kernels(step, before=before)
    assert calls == [1]
    # forward addmm + sum; backward: the sum's gradient (ones expanded: ones_like or fill), mm for the weight, sum for
    # the bias; more than the forward's two, whatever the exact decomposition
    assert forward_and_backward > 4
