"""Review 14's holes in the first-step independence check (runner/methods/privacy_check/independence.py): each model
below was accepted and one example then moved another's release by more than C. The first step of reweight (bk) on
a few float32 CPU examples, the refusal asserted, and the same model without its coupling still accepted.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.privacy_check.independence import rows_differ

D = 8
COUPLED = "depend on the other examples of the batch"


def loss_fn(out, y):
    return F.cross_entropy(out[:, :3], y, reduction="none") + out[:, 3:].sum(1)  # (B,); column 3, if any, added


def first_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """The first private step's clipped sum (its privacy check), reweight bk, sigma 0."""
    torch.manual_seed(0)
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=0.0)
    model = method.attach(model)
    method.clipped_sum(model, loss_fn, x, y)
    assert method._privacy_checked is not None


def features(B=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g), torch.randint(0, 3, (B,), generator=g)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, 3)

    def head(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


# -- H2: coupling only while autograd records ---------------------------------------------------------------------

class CentredWithGrad(Net):
    """x - x.mean(0) only under torch.is_grad_enabled(): the check's forwards ran under no_grad (7.7 C released)."""

    def __init__(self, k: float = 1.0):
        super().__init__()
        self.k = k

    def forward(self, x):
        if torch.is_grad_enabled():
            x = x - self.k * x.mean(0, keepdim=True)
        return self.head(x)


def test_coupling_only_with_gradients_enabled_is_refused():
    with pytest.raises(DprunError, match=COUPLED):
        first_step(CentredWithGrad(), *features())
    first_step(CentredWithGrad(k=0.0), *features())  # the same model uncoupled: accepted


# -- H7: one row's huge entry set the tolerance of every row ------------------------------------------------------

class CentredBesideAHugeRow(Net):
    """Plain x - x.mean(0), and a gradient-free column that is `huge` on rows whose features sum above 30 (added to
    their loss): one tolerance scale for the whole tensor (1e30) hid the centring in every other row (4.26 C)."""

    def __init__(self, huge: float = 1e30, centred: bool = True):
        super().__init__()
        self.huge, self.centred = huge, centred

    def forward(self, x):
        marker = (x.sum(1, keepdim=True) > 30).to(x.dtype) * self.huge  # (B, 1)
        h = x - x.mean(0, keepdim=True) if self.centred else x
        return torch.cat([self.head(h), marker], 1)  # (B, 4)


def test_one_rows_huge_entry_does_not_hide_centring_in_the_others():
    x, y = features()
    x[1] = 5.0  # the marker row (its sum, 40, the batch's largest: probed)
    with pytest.raises(DprunError, match=COUPLED):
        first_step(CentredBesideAHugeRow(), x, y)
    first_step(CentredBesideAHugeRow(centred=False), x, y)  # the huge row alone: accepted


def test_rows_differ_scales_each_row_by_its_own_entries():
    a = torch.tensor([[1e30, 0.0], [1.0, 2.0]])
    assert not rows_differ(a, a.clone())
    assert rows_differ(a, torch.tensor([[1e30, 0.0], [1.0, 2.001]]))  # row 1's change, not hidden by row 0's 1e30
    assert not rows_differ(a, torch.tensor([[1e30 * (1 + 1e-9), 0.0], [1.0, 2.0]]))  # within row 0's own scale
    assert rows_differ(torch.tensor(2.0), torch.tensor(2.001)) and not rows_differ(torch.tensor(1e30),
                                                                                   torch.tensor(1e30 * (1 + 1e-9)))
    inf, nan = float("inf"), float("nan")  # review 12/13: finite in one forward only differs; nan, nan and inf agree
    b = torch.tensor([[inf, nan], [1.0, 2.0]])
    assert not rows_differ(b, b.clone()) and rows_differ(b, torch.tensor([[0.0, nan], [1.0, 2.0]]))


# -- H5: coupling on the float32 path alone, inside the 1e-3 rounding band ------------------------------------------

class Float32OnlyWeak(Net):
    """x + eps * x.sum(0) on the float32 path alone, small enough to stay inside ROUNDING: the float64 copy (no
    coupling there) cleared it (5.3 C released through an outlier record)."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32:
            x = x + self.eps * x.sum(0, keepdim=True)
        return self.head(x)


class OddBatchRounded(Net):
    """Sound, but its float32 output is off by 6e-5 relative for an odd batch (a kernel per shape rounding otherwise,
    exaggerated): only the removed probe (k - 1 rows) sees it, and the float64 copy clears it."""

    def forward(self, x):
        h = self.head(x)
        return h * (1 + 2.0**-14) if h.dtype == torch.float32 and len(x) % 2 else h


def test_float32_only_coupling_inside_the_rounding_band_is_refused():
    with pytest.raises(DprunError, match=COUPLED + ".*replaced"):
        first_step(Float32OnlyWeak(), *features())
    first_step(Float32OnlyWeak(eps=0.0), *features())
    first_step(OddBatchRounded(), *features())  # rounding of another batch shape: still accepted


# -- coupling only under autocast (precision=bf16): the step's forward runs there, the probes ran outside it -----

class CentredUnderAutocast(Net):
    def __init__(self, k: float = 1.0):
        super().__init__()
        self.k = k

    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):
            x = x - self.k * x.mean(0, keepdim=True)
        return self.head(x).float()


@pytest.mark.parametrize("mode", ["bk"])  # (twopass and recompute refuse bf16 themselves)
def test_coupling_only_under_autocast_is_refused_under_bf16(mode):
    x, y = features()
    torch.manual_seed(0)
    method = METHODS.build("reweight", cfg={"mode": mode}, clip=1.0, sigma=0.0).configure(precision="bf16")
    model = method.attach(CentredUnderAutocast())
    with pytest.raises(DprunError, match=COUPLED):
        method.clipped_sum(model, loss_fn, x, y)
    method = METHODS.build("reweight", cfg={"mode": mode}, clip=1.0, sigma=0.0).configure(precision="bf16")
    model = method.attach(CentredUnderAutocast(k=0.0))  # the same model uncoupled: accepted under bf16
    method.clipped_sum(model, loss_fn, x, y)
    assert method._privacy_checked is not None
