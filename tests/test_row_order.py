"""runner/methods/privacy_check/row_order.py and probe_rows.feature_extremes: which training records the first
step's reorder check adds, checked against brute force (tests/test_privacy_validator.py checks the refusals)."""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from runner.methods.privacy_check import probe_rows, row_order


def test_feature_extremes_are_each_features_largest_and_smallest_finite_entry(monkeypatch):
    monkeypatch.setattr(probe_rows, "CHUNK", 7)  # several chunks, the last one short
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, 3, generator=g)
    x[4, 1, 2] = float("nan")  # a non-finite entry is never an extreme, but its record can be another feature's
    x[4, 0, 0] = 99.0  # (review 14: a record with a nan input the model imputes carried a flag; never probed: 7-568 C)
    x[11, 0, 1] = float("inf")
    found = probe_rows.feature_extremes(TensorDataset(x, torch.zeros(30)))
    flat = x.reshape(30, -1)
    finite = torch.isfinite(flat)
    assert torch.equal(found.largest, flat.masked_fill(~finite, float("-inf")).amax(0))
    assert torch.equal(found.smallest, flat.masked_fill(~finite, float("inf")).amin(0))
    assert float(found.largest[0]) == 99.0 and int(found.at_largest[0]) == 4
    assert torch.equal(flat[found.at_largest, torch.arange(6)], found.largest)
    assert torch.equal(flat[found.at_smallest, torch.arange(6)], found.smallest)
    tokens = torch.randint(0, 50, (40, 9), generator=g)
    found = probe_rows.feature_extremes(TensorDataset(tokens, torch.zeros(40)))
    assert torch.equal(found.largest, tokens.amax(0)) and torch.equal(tokens[found.at_smallest, torch.arange(9)],
                                                                       tokens.amin(0))


def test_the_records_added_cover_every_feature_outside_the_batchs_range():
    """Texts of 30-60 tokens among 2000, one of 100: a batch of the short ones gets the long one (it alone lies
    outside the batch's range at every position past 60) and records shorter than the batch's shortest."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(30, 61, (2000,), generator=g)
    lengths[1234] = 100
    x = torch.randint(1, 9, (2000, 100), generator=g)
    x[torch.arange(100)[None, :] >= lengths[:, None]] = 0
    method = type("M", (), {})()
    probe_rows.attach_probes(method, TensorDataset(x, torch.zeros(2000)))
    batch = x[(lengths >= 40) & (lengths <= 50)][:32]
    rows = row_order.rows_to_check(method, batch)
    added = rows[:len(rows) - len(batch)]
    assert torch.equal(rows[len(added):], batch)
    assert any(torch.equal(r, x[1234]) for r in added)  # the long text
    assert bool(((added != 0).sum(1) < 40).any())  # a text shorter than every one of the batch
    seen = batch.reshape(len(batch), -1)
    outside = lambda rows_: (rows_ > seen.amax(0)) | (rows_ < seen.amin(0))  # noqa: E731
    need = outside(x).any(0)  # every feature some training record lies outside the batch's range on
    assert torch.equal(outside(added).any(0), need)
    assert len(added) <= 20  # a few records cover them (greedy), not one per feature


def test_rows_are_matched_by_their_nearest_sketch_not_a_tolerance():
    """A call's rows matched to their own, offset or not; a swap of two rows that differ by 1e-4 of their norm (review
    10: a relative tolerance let it pass) is seen; exact duplicates swapped are not a reorder."""
    g = torch.Generator().manual_seed(0)
    rows = 1e3 + 0.01 * torch.randn(16, 5, 3, generator=g)  # (n, ...) a call's input, a large common offset
    order = row_order.shuffles(16)[0]
    drawn, permuted = row_order.sketch(rows), row_order.sketch(rows[order])
    assert not row_order.moved(drawn, permuted, order, 1e-7)
    swapped = rows[order].clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert row_order.moved(drawn, row_order.sketch(swapped), order, 1e-7)
    twins = rows.clone()
    twins[3] = twins[7]
    swapped = twins[order].clone()
    i, j = int((order == 3).nonzero()[0, 0]), int((order == 7).nonzero()[0, 0])
    swapped[[i, j]] = swapped[[j, i]]
    assert not row_order.moved(row_order.sketch(twins), row_order.sketch(swapped), order, 1e-7)
    nan_row = rows.clone()
    nan_row[5] = float("nan")  # a row that is not finite is never counted
    assert not row_order.moved(row_order.sketch(nan_row), row_order.sketch(nan_row[order]), order, 1e-7)


def test_texts_that_open_alike_are_not_a_reorder():
    """The real IMDB's first step was refused (4dac788): texts that start with the same tokens have the same hidden
    states at a recurrent layer's first calls, and rounding at two batch positions put a twin nearer than a row's own.
    A row counts as moved only when its own row lies further than rounding explains (`moved`'s floor)."""
    import torch.nn.functional as F

    import dprun
    from runner.data.base import DataInfo
    from runner.models import MODELS

    for name in ("lstm", "bilstm", "gru"):
        g = torch.Generator().manual_seed(0)
        n, T, V = 400, 40, 100
        x = torch.randint(1, V, (n, T), generator=g)
        x[:, :6] = torch.randint(1, V, (6,), generator=g)  # every text opens with the same 6 tokens
        lengths = torch.randint(8, T + 1, (n,), generator=g)
        x[torch.arange(T)[None, :] >= lengths[:, None]] = 0
        y = torch.randint(0, 2, (n,), generator=g)
        torch.manual_seed(0)
        model = MODELS.build(name, DataInfo("imdb", (T,), 2, "text", V, n))
        private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), method="reweight",
                                     batch_size=64, seed=0)
        xb, yb = next(iter(private.batches()))
        private.step(xb, yb, lambda out, t: F.cross_entropy(out, t, reduction="none"))
        assert private.steps == 1, name


class Tf32PositionRounding(torch.nn.Module):
    """precision=tf32's cuDNN convolutions on CUDA, emulated: while TF32 is on, a row's output is rounded by its batch
    position (stop 62, an H200: ResNet-18's rows 7e-4 of their norm apart at its 20th conv in two batch orders, 0 with
    float32 products). (n, d) -> (n, d)."""

    def forward(self, x):
        from runner import fp32_mode

        if fp32_mode.tf32_enabled():
            return x * (1 + 3e-3 * torch.arange(len(x), dtype=x.dtype)[:, None] / len(x))  # beyond float32's floor
        return x


class SortsByFirstFeature(torch.nn.Module):
    """Feeds the next layer the rows sorted by their first feature, then restores the order (a packing by length);
    `gated`: only while TF32 is allowed, as a "fast path" might (review 34: a check with TF32 paused released 1.054 C)."""

    def __init__(self, gated: bool = False):
        super().__init__()
        self.inner = torch.nn.Linear(16, 16)
        self.gated = gated

    def forward(self, x):  # (n, 16)
        if self.gated and not torch.backends.cuda.matmul.allow_tf32:
            return self.inner(x)
        order = x[:, 0].argsort()
        return self.inner(x[order])[order.argsort()]


def test_tf32_rounding_by_batch_position_is_not_a_reorder_and_a_sort_is_still_one(monkeypatch):
    """On CUDA with TF32 on (emulated: the check's rows taken for a TF32 device), the check's first pass keeps the
    step's flags at TF32's floor, its second takes float32 products at float32's: a sound model whose TF32 kernels
    round rows by their position (stop 62: ResNet-18 refused on an H200 under precision=tf32) passes, and a forward
    that sorts its rows is refused, also one that sorts only while TF32 is allowed (review 34). Off CUDA one pass
    with the step's flags refuses the gated sort too."""
    import pytest

    from runner import fp32_mode
    from runner.errors import DprunError
    from runner.methods import METHODS

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)  # (n, d)
    method = METHODS.build("reweight", cfg={}, clip=1.0, sigma=1.0).configure(precision="tf32")

    def models():
        torch.manual_seed(0)
        sound = torch.nn.Sequential(torch.nn.Linear(8, 16), Tf32PositionRounding(), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2))
        sorting = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), SortsByFirstFeature(gated),
                                       torch.nn.Linear(16, 2)) for gated in (False, True)]
        return sound, sorting

    with fp32_mode.float32_mode("cuda", tf32=True):  # what precision=tf32 sets for a CUDA step (matmul_precision)
        sound, sorting = models()
        assert row_order.reordered(sound, x, 1e-7) is not None  # a reorder at float32's floor, by rounding alone
        for model in sorting:  # off CUDA: one pass, the step's flags
            with pytest.raises(DprunError, match=r"inner \(Linear\) is fed the examples in another order"):
                row_order.check_row_order(method, model, x)
        monkeypatch.setattr(row_order, "tf32_rounds", lambda rows: True)
        row_order.check_row_order(method, sound, x)  # passes: TF32's floor, then float32 products
        for model in sorting:
            with pytest.raises(DprunError, match=r"inner \(Linear\) is fed the examples in another order"):
                row_order.check_row_order(method, model, x)
        assert fp32_mode.tf32_enabled()  # the step's TF32 back after the check


def test_a_tf32_pause_nested_in_another_keeps_tf32_off_until_the_outermost_ends():
    """runner/fp32_mode.py's cheap pause inside a step's float32_mode(cuda, tf32=True): each exit puts back what its
    entry found (review 34: an inner pause's exit turned TF32 back on inside the outer pause)."""
    from runner import fp32_mode

    with fp32_mode.float32_mode("cuda", tf32=True):
        assert fp32_mode.tf32_enabled()
        with fp32_mode.tf32_paused():
            with fp32_mode.tf32_paused():
                assert not fp32_mode.tf32_enabled()
            assert not fp32_mode.tf32_enabled()
        assert fp32_mode.tf32_enabled()


class SortsNearNeighbours(torch.nn.Module):
    """Review 35's construction: a tanh near saturation makes every row of the next layer's input ~1e-5 of its norm
    from the others (under bf16's floor of 1e-3), and that layer is fed the rows stably sorted by a rare feature (0.3
    in most records, 0.4 in a few: bucketing). (n, 32) -> (n, 2)."""

    def __init__(self):
        super().__init__()
        self.l1, self.bucketed = torch.nn.Linear(32, 16), torch.nn.Linear(16, 2)
        with torch.no_grad():
            self.l1.weight.mul_(0.05)
            self.l1.bias.copy_(6 * torch.sign(torch.randn(16, generator=torch.Generator().manual_seed(0))))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        order = torch.argsort(x[:, 5], stable=True)
        return self.bucketed(h[order])[order.argsort()]


def test_a_reorder_among_near_neighbours_is_refused_under_bf16_by_the_float32_pass():
    """Under bf16 the check's first pass (the step's autocast, floor 1e-3) cannot see a reorder among rows nearer than
    its floor (review 35: 2.0 C over three such layers); its second pass, float32 products without autocast at
    float32's floor, refuses it."""
    import pytest

    from runner.errors import DprunError
    from runner.methods import METHODS

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    x[:, 5] = 0.3
    x[[7, 30, 51], 5] = 0.4  # three flagged records, moved to the end of the bucketed layer's input
    torch.manual_seed(0)
    model = SortsNearNeighbours()
    method = METHODS.build("reweight", cfg={}, clip=1.0, sigma=1.0).configure(precision="bf16")
    with method.autocast(x):
        assert row_order.reordered(model, x, 1e-3) is None  # the gap at bf16's floor
    with pytest.raises(DprunError, match=r"bucketed \(Linear\) is fed the examples in another order"):
        row_order.check_row_order(method, model, x)
