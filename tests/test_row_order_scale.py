"""The row-order check's units (runner/methods/privacy_check/row_order.py column_scale): one training record of 1e9
on every feature, added to the check because it lies outside the batch's range, set every column's unit when the
unit was the column's largest magnitude; the other rows' differences fell below the floor and a swap of two rows
keyed on a rare flag passed (review 16: twopass 1.9-2011 C on 20 of 21 seeds). The unit is now the lower median of
the column's non-zero magnitudes."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.privacy_check.probe_rows import attach_probes
from runner.methods.privacy_check.row_order import column_scale

D = 24


class SwapLinear(nn.Module):
    """Swaps the flagged record (feature 0 = 0.4; the others 0.3) with the next row around its one Linear, whose input
    does not hold the flag (a constant column of 1 in its place)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3)

    def forward(self, x):  # (B, D)
        a = torch.cat([torch.ones_like(x[:, :1]), x[:, 1:]], 1)
        perm = torch.arange(len(x))
        flagged = (x[:, 0] > 0.35).nonzero()[:, 0]
        if len(flagged) and len(x) >= 2:
            i = int(flagged[0])
            perm[i], perm[(i + 1) % len(x)] = (i + 1) % len(x), i
        return self.fc(a[perm])[perm]


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("huge", [0.0, 1e9], ids=["control", "huge_record"])
@pytest.mark.parametrize("mode", ["twopass", "bk"])
def test_a_huge_training_record_does_not_set_the_rows_units(mode, huge):
    assert_swap_refused(SwapLinear(), mode, seed=0, huge=huge)


def assert_swap_refused(model: nn.Module, mode: str, seed: int, huge: float = 0.0) -> None:
    """300 records of D features, a rare flag (feature 0 = 0.4) on record 100 only, not in the first batch of 32;
    `huge` on every other feature of record 200: the first step refuses the model's swap."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 10)
    X, Y = torch.randn(300, D, generator=g), torch.randint(0, 3, (300,), generator=g)
    X[:, 0] = 0.3
    X[100, 0] = 0.4
    if huge:
        X[200, 1:] = huge
    method = METHODS.build("reweight", cfg={"mode": mode}, clip=1.0, sigma=0.0)
    data = torch.utils.data.TensorDataset(X, Y)
    model = method.attach(model, data)
    attach_probes(method, data)
    with pytest.raises(DprunError, match="is fed the examples in another order"):
        method.clipped_sum(model, loss_fn, X[:32], Y[:32])


def test_column_scale_is_a_lower_median_of_the_non_zero_magnitudes():
    x = torch.tensor([[1.0, 0.0, 5.0, 0.0], [2.0, 0.0, -1e9, float("nan")], [3.0, 0.0, 3.0, 0.0],
                      [-4.0, 7.0, 4.0, 0.0]])
    assert column_scale(x).tolist() == [2.0, 7.0, 4.0, 1.0]  # (1, 2, 3, 4) -> 2; only 7; (3, 4, 5, 1e9) -> 4; none
    tokens = torch.tensor([[3, 0], [5, 0], [4, 9]])
    assert column_scale(tokens).tolist() == [4.0, 9.0]


class BucketSwap(SwapLinear):
    """The swap again, with 64 columns of the rows' own after it: 1e-30 everywhere and 1 in a bucket hashed from the
    row's features. Each column's median is 1e-30, so a row's norm in x / scale units was ~1e30 and the floor ~1e23;
    and in any units each swapped row lies far from every drawn row, its own too (review 17: twopass 3.1-3.7 C)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D + 64, 3)

    def forward(self, x):
        a = torch.cat([torch.ones_like(x[:, :1]), x[:, 1:]], 1)
        buckets = 1e-30 + F.one_hot((x[:, 1:4].abs() * 1e4).long().sum(1) % 64, 64).to(x.dtype)  # (B, 64)
        perm = torch.arange(len(x))
        flagged = (x[:, 0] > 0.35).nonzero()[:, 0]
        if len(flagged) and len(x) >= 2:
            i = int(flagged[0])
            perm[i], perm[(i + 1) % len(x)] = (i + 1) % len(x), i
        return self.fc(torch.cat([a[perm], buckets], 1))[perm]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_swap_behind_columns_of_the_rows_own_is_refused(seed):
    assert_swap_refused(BucketSwap(), "twopass", seed)


def test_an_all_zero_row_does_not_move_by_the_sketchs_own_rounding():
    """A fully masked example's row is all zeros (norm 0): the float64 centring put its sketch 5.6e-17 from its own,
    above a floor of 0 x its norm, and the masked BiLSTM toy was refused on most of the OS-drawn shuffles (the
    chunked-step tests skipped it, a refusal being a skip there). Eight first steps, each with a fresh shuffle."""
    from test_exact_methods import TOYS
    from test_physical_batch import step_once  # (a refusal there is pytest.skip: here it must not happen)

    build, info = TOYS["toy_bilstm_masked"]
    for _ in range(8):
        try:
            step_once("reweight", {"mode": "bk"}, build, info, 2)
        except pytest.skip.Exception as e:
            pytest.fail(str(e))


def test_moved_allows_the_sketchs_own_rounding_at_a_row_of_norm_0():
    """The mechanism of the test above, deterministic: sketches (n, SKETCH + 1) of 5 rows, one of norm 0, each permuted
    row 5.6e-17 from its own (float64 centring): not moved; 1e-3 from its own at a norm of 1.6: moved."""
    from runner.methods.privacy_check.row_order import SKETCH, moved

    g = torch.Generator().manual_seed(0)
    drawn = torch.cat([torch.randn(5, SKETCH, generator=g, dtype=torch.float64),
                       torch.tensor([[0.0], [1.6], [1.5], [1.0], [1.2]], dtype=torch.float64)], 1)
    order = torch.tensor([1, 2, 3, 4, 0])
    permuted = drawn[order].clone()
    permuted[:, :SKETCH] += 5.6e-17
    assert not moved(drawn, permuted, order, 1e-12)
    permuted[1, :SKETCH] += 1e-3
    assert moved(drawn, permuted, order, 1e-12)
