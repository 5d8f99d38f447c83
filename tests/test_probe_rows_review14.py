"""Review 14: which rows the first step's check probes (probe_rows.py, first_step.probe) and the row-order check's
rounding floor (row_order.py). Each model below was accepted before and released more than C per example."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.privacy_check import probe_rows, row_order

REORDERED = "is fed the examples in another order"


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def first_step(model, x, y, data, mode="twopass"):
    """The method's first (checked) step on x, y, the training set `data` attached as assemble() does."""
    method = METHODS.build("reweight", cfg={"mode": mode}, clip=1.0, sigma=0.0)
    model = method.attach(model, data)
    probe_rows.attach_probes(method, data)
    method.clipped_sum(model, loss_fn, x, y)
    return method


# -- H1: records with a nan input that the model imputes are probed ------------------------------------------------

class ImputedCoupled(nn.Module):
    """Every row's logits move with the mean over the batch's records with a missing value (imputed: finite loss and
    gradient, so they are trained on); no other record couples (review 14 nan_coupled.py: bk 7 C, twopass 51 C)."""

    def __init__(self, d=8):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, 3), nn.Linear(d, 3)

    def forward(self, x):
        missing = torch.isnan(x).any(1, keepdim=True).to(x.dtype)  # (B, 1)
        x = torch.nan_to_num(x, nan=0.0)
        pooled = (missing * self.fc2(x)).sum(0, keepdim=True) / missing.sum().clamp(min=1)
        return self.fc(x) + 5.0 * pooled


class Imputed(nn.Module):
    """Sound: a missing value imputed, each row alone."""

    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(torch.nan_to_num(x, nan=0.0))))


def imputed_data(n=200, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)
    x[100:105, 3] = float("nan")
    x[0:3, 3] = float("nan")  # three in the first batch
    return x, y


def test_a_batch_coupled_only_through_imputed_records_is_refused():
    x, y = imputed_data()
    torch.manual_seed(0)
    with pytest.raises(DprunError, match="depend on the other examples"):
        first_step(ImputedCoupled(), x[:32], y[:32], TensorDataset(x, y), mode="bk")


def probed(monkeypatch):
    """The probe rows of each first_step.probe call, as a list filled by the calls."""
    from runner.methods.privacy_check import first_step as fs

    seen, original = [], fs.probe
    monkeypatch.setattr(fs, "probe", lambda *a: seen.append(original(*a)) or seen[-1])
    return seen


def test_a_sound_model_that_imputes_is_accepted_and_its_imputed_records_are_probed(monkeypatch):
    x, y = imputed_data()
    seen = probed(monkeypatch)
    torch.manual_seed(0)
    assert first_step(Imputed(), x[:32], y[:32], TensorDataset(x, y))._privacy_checked is not None
    assert int(torch.isnan(seen[0][0]).any(1).sum()) >= 2  # of the batch and of the training set


def test_rows_whose_loss_is_not_finite_are_still_skipped(monkeypatch):
    """A model that does not impute: the rows with a nan input have a nan loss (nothing released), so they are not
    probed, and the others are."""
    class Plain(Imputed):
        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    x, y = imputed_data()
    seen = probed(monkeypatch)
    torch.manual_seed(0)
    assert first_step(Plain(), x[:32], y[:32], TensorDataset(x, y))._privacy_checked is not None
    assert len(seen[0][1]) >= 4 and bool(torch.isfinite(seen[0][0]).all())


def test_a_sort_by_a_flag_only_imputed_records_carry_is_refused():
    """review 14 nan_imputed.py: a stable sort by feature 0 (0.4 only in records with a missing value), the layer on
    the sorted rows, the order restored: twopass 568 C through make_private. The record is in the training set, not
    in the first batch; the row-order check adds it (its other features are finite extremes)."""
    class Sorted(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 16), nn.Linear(16, 3)

        def forward(self, x):
            x = torch.nan_to_num(x, nan=0.0)
            order = torch.argsort(x[:, 0], stable=True)
            return self.fc2(torch.tanh(self.fc1(x))[order])[torch.argsort(order)]

    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(300, 8, generator=g), torch.randint(0, 3, (300,), generator=g)
    x[:, 0] = 0.3
    x[100, 0], x[100, 5] = 0.4, float("nan")
    torch.manual_seed(0)
    with pytest.raises(DprunError, match=REORDERED):
        first_step(Sorted(), x[:32], y[:32], TensorDataset(x, y))
    found = probe_rows.feature_extremes(TensorDataset(x, y))
    assert int(found.at_largest[0]) == 100  # its finite entries count; the nan one is never an extreme
    assert bool(torch.isfinite(found.largest).all())
    method = type("M", (), {})()
    probe_rows.attach_probes(method, TensorDataset(x, y))
    batch = x[95:127]  # holds record 100
    rows = row_order.rows_to_check(method, batch)
    assert torch.equal(rows[-len(batch):].nan_to_num(7.0), batch.nan_to_num(7.0))  # its nan row kept


# -- H3: training records read as the DataLoader's collate_fn makes the batch ------------------------------------

def to_float(batch):
    x, y = default_collate(batch)
    return x.float() / 4, y


class SortedByFlag(nn.Module):
    """A stable sort by feature 0 (3 in every record, 4 in one), the layer on the sorted rows, the order restored
    (review 14 uint8_collate.py: 2.56 C bk, 319 C twopass, uint8 records cast to float by collate_fn)."""

    def __init__(self, d=12):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 16), nn.Linear(16, 3)

    def forward(self, x):
        order = torch.argsort(x[:, 0], stable=True)
        return self.fc2(torch.tanh(self.fc1(x))[order])[torch.argsort(order)]


def uint8_data(n=300, d=12):
    g = torch.Generator().manual_seed(10)
    x = torch.randint(0, 4, (n, d), generator=g, dtype=torch.uint8)
    x[:, 0] = 3
    x[100, 0] = 4
    return x, torch.randint(0, 3, (n,), generator=g)


def test_records_join_the_probe_as_the_collate_fn_makes_them():
    x, y = uint8_data()
    method = type("M", (), {})()
    probe_rows.attach_probes(method, TensorDataset(x, y), to_float)
    records, _, names = method.probe_records
    assert records.dtype == torch.float32 and "training record 100" in names
    assert torch.equal(records[names.index("training record 100")], x[100].float() / 4)
    got = method.probe_features.records(torch.tensor([100, 7]))[0]
    assert torch.equal(got, x[[100, 7]].float() / 4) and float(method.probe_features.largest[0]) == 1.0


@pytest.mark.parametrize("mode", ["bk", "twopass"])
def test_a_sort_by_a_rare_flag_of_uint8_records_collated_to_float_is_refused(mode):
    import dprun

    x, y = uint8_data()
    torch.manual_seed(0)
    model = SortedByFlag()
    loader = DataLoader(TensorDataset(x, y), batch_size=30, collate_fn=to_float)
    private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, method="reweight",
                                 method_options={"mode": mode}, noise_multiplier=1.0, max_grad_norm=1.0, seed=2)
    with pytest.raises(DprunError, match=REORDERED):
        for xb, yb in private.batches():
            assert not bool((xb[:, 0] > 0.9).any())  # the first batch ties on the flag: only the records show it
            private.step(xb, yb, loss_fn)
    assert private.steps == 0


def test_records_the_batch_cannot_hold_are_named_in_a_warning(caplog):
    x, y = uint8_data()
    method = METHODS.build("reweight", cfg={"mode": "twopass"}, clip=1.0, sigma=0.0)
    data = TensorDataset(x, y)
    model = method.attach(Imputed(d=6), data)
    probe_rows.attach_probes(method, data, lambda b: (to_float(b)[0][:, :6], to_float(b)[1]))
    method.probe_records = (method.probe_records[0][:, :5], *method.probe_records[1:])  # rows unlike the batch's
    xb = x[:20, :6].float() / 4
    with caplog.at_level(logging.WARNING, logger="dprun"):
        method.clipped_sum(model, loss_fn, xb, y[:20])
    assert "leaves out the training records with extreme keys" in caplog.text


def test_the_cli_trains_on_the_stored_rows():
    """The CLI's batches are train_x[idx] gathers of the tensors as stored (runner/train.py; images normalised at
    load, in the run's dtype): records read without a collate_fn are those rows."""
    from runner.data.base import DataInfo, Dataset

    x, y = uint8_data()
    data = Dataset(DataInfo("t", (12,), 3), x.float(), y, x[:0].float(), y[:0])
    records = probe_rows.batched(data)
    assert torch.equal(records(torch.tensor([3, 100]))[0], x[[3, 100]].float())


# -- H6: the row-order floor is a rounding model per coordinate ---------------------------------------------------

class OffsetSorted(nn.Module):
    """offset_sort.py: one exact constant column of `big` in the layer's input, the layer on rows sorted by a rare
    flag (feature 0), order restored. With big = 1e9 the floor of 1e-7 of the raw row's norm was ~100, and the sort
    passed (twopass 1.3e3-7.9e8 C, 1.5e10 C through make_private)."""

    def __init__(self, big, d=24):
        super().__init__()
        self.big, self.fc = big, nn.Linear(1 + d, 3)
        with torch.no_grad():
            self.fc.weight[:, 0] = 0.0

    def forward(self, x):
        a = torch.cat([torch.full_like(x[:, :1], self.big), x], 1)
        order = torch.argsort(x[:, 0], stable=True)
        return self.fc(a[order])[torch.argsort(order)]


@pytest.mark.parametrize("big", [1.0, 1e9])
def test_a_sort_behind_a_large_constant_column_is_refused(big):
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(300, 24, generator=g), torch.randint(0, 3, (300,), generator=g)  # wider than COLUMNS
    x[:, 0] = 0.3
    x[100, 0] = 0.4
    torch.manual_seed(0)
    with pytest.raises(DprunError, match=REORDERED):
        first_step(OffsetSorted(big), x[:32], y[:32], TensorDataset(x, y))


def test_rows_with_a_large_constant_column_and_duplicates_are_not_moved():
    """A sound layer behind the same constant column, the batch full of exact duplicates: accepted; in the sketch's
    units a row's own is exactly where it was, a twin no nearer."""
    class Offset(nn.Module):
        def __init__(self, big=1e9, d=12):
            super().__init__()
            self.big, self.fc = big, nn.Linear(1 + d, 3)

        def forward(self, x):
            return self.fc(torch.cat([torch.full_like(x[:, :1], self.big), x], 1))

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(300, 12, generator=g), torch.randint(0, 3, (300,), generator=g)
    x[:16] = x[16:32]  # the first batch: each row twice
    torch.manual_seed(0)
    assert first_step(Offset(), x[:32], y[:32], TensorDataset(x, y))._privacy_checked is not None
    rows = torch.cat([torch.full((32, 1), 1e9), x[:32]], 1)
    order = row_order.shuffles(32)[0]
    assert not row_order.moved(row_order.sketch(rows), row_order.sketch(rows[order], row_order.column_scale(rows)),
                               order, 1e-7)
