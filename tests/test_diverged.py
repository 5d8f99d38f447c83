"""A run whose loss or parameters become non-finite ends as `diverged` (exit 3), keeps its complete epochs, and shows
in dprun-report among the runs that did not finish; a capped evaluation is a fixed stratified subset."""
from __future__ import annotations

import json

import numpy as np

import pandas as pd
import pytest
import torch

from conftest import compose_config, dprun_in_process
from runner.evaluation import eval_subset, evaluate
from runner.train import Diverged, train


def test_a_huge_learning_rate_ends_the_run_as_diverged_with_exit_3(tmp_path):
    """The issue's command: `dprun lr=1e9 epochs=2 model=cnn method=reweight` said finished, test_acc 0.1, exit 0."""
    out = tmp_path / "run"
    proc = dprun_in_process("lr=1e9", "epochs=2", "model=cnn", "method=reweight", "progress=false",  # the CLI, here
                            "max_steps_per_epoch=30", f"out_dir={out}", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dprun: run diverged: every example's training loss (or gradient) became non-finite")
    assert "epoch 1, step" in last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and "epoch 1, step" in summary["error"]
    assert summary["epochs_completed"] == 0 and summary["final"] == {}


def test_divergence_in_epoch_2_keeps_epoch_1_and_its_checkpoint(tmp_path, monkeypatch):
    import runner.train as tr

    original = tr.record_epoch

    def poison_after_epoch_1(run, row, eps):  # as if the first update of epoch 2 blew the weights up
        original(run, row, eps)
        if row["epoch"] == 1:
            with torch.no_grad():
                next(run.model.parameters()).fill_(float("nan"))

    monkeypatch.setattr(tr, "record_epoch", poison_after_epoch_1)
    with pytest.raises(Diverged, match=r"epoch 2, step 1 \(lr=0.5\); the 1 complete epoch"):
        train(compose_config(["epochs=3", "progress=false", "max_steps_per_epoch=4", "method=reweight"]), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["epochs_completed"] == 1 and summary["final"]["epoch"] == 1
    assert pd.read_csv(tmp_path / "metrics.csv").epoch.tolist() == [1]
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == 1 and all(torch.isfinite(t).all() for t in saved["model"].values())


def test_a_non_finite_parameter_with_finite_losses_is_caught_at_the_epoch_end(tmp_path, monkeypatch):
    """A parameter the loss does not reach (an unused head) becomes nan: the losses stay finite, the epoch check
    still stops the run."""
    import runner.train as tr

    original = tr.run_epoch

    def poison_an_unused_parameter(run, epoch):
        run.model.register_parameter("unused", torch.nn.Parameter(torch.full((2,), float("nan"))))
        return original(run, epoch)

    monkeypatch.setattr(tr, "run_epoch", poison_an_unused_parameter)
    with pytest.raises(Diverged, match="a parameter became non-finite .* by the end of epoch 1"):
        train(compose_config(["epochs=1", "progress=false", "max_steps_per_epoch=2"]), tmp_path)


@pytest.mark.parametrize("method", ["reweight", "jl", "nxbp"])
def test_records_that_are_not_finite_neither_end_the_run_nor_poison_its_loss(tmp_path, monkeypatch, method):
    """One record's loss or gradient that is not finite used to end the run as diverged (the loss summed to nan): its
    presence decided the run's outcome. It adds nothing to the release (docs/privacy.md), the run goes on, and the
    epoch counts such records (nonfinite_records, a private diagnostic); train_loss is over the finite ones."""
    import runner.train as tr

    original = tr.run_epoch

    def poison_some_records(run, epoch):
        run.data.train_x[:40] = float("inf")  # 40 of the training records: some in every batch, never a whole one
        return original(run, epoch)

    monkeypatch.setattr(tr, "run_epoch", poison_some_records)
    summary = train(compose_config(["epochs=1", "progress=false", "max_steps_per_epoch=4", f"method={method}"]),
                    tmp_path)
    assert summary["status"] == "finished"
    row = pd.read_csv(tmp_path / "metrics.csv").iloc[0]
    assert row.nonfinite_records > 0 and np.isfinite(row.train_loss)
    assert all(torch.isfinite(p).all() for p in torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"].values())
    assert any("nonfinite_records" in note for note in summary["privacy_notes"])
    assert any(note.startswith("epsilon covers this run alone") and "timings" in note and "peak_mem_bytes" in note
               for note in summary["privacy_notes"])


def test_report_lists_a_diverged_run_as_not_finished(tmp_path, monkeypatch):
    from runner import report

    run = tmp_path / "outputs" / "runs" / "x"
    with pytest.raises(Diverged):
        train(compose_config(["lr=1e9", "epochs=1", "model=cnn", "method=reweight", "progress=false",
                              "max_steps_per_epoch=30"]), run)
    runs = report.collect(tmp_path / "outputs")
    row = runs[runs["run_dir"].astype(str).str.endswith("x")].iloc[0]
    assert row["status"] == "diverged"


def test_capped_evaluation_is_a_fixed_stratified_subset_of_a_label_sorted_split():
    """IMDB's test split is stored sorted by label: the first examples are one class (two capped runs scored 0.35
    and 0.75). The subset keeps the classes' proportions and is the same for every run."""
    y = torch.cat([torch.zeros(600, dtype=torch.long), torch.ones(400, dtype=torch.long)])  # sorted by label
    idx = eval_subset(y, 100)
    assert len(idx) == 100 and len(set(idx.tolist())) == 100
    assert int((y[idx] == 0).sum()) == 60 and int((y[idx] == 1).sum()) == 40
    assert torch.equal(idx, eval_subset(y, 100))  # fixed
    assert not torch.equal(idx, torch.arange(100))
    # a model that always says "class 0": the first 100 examples would report 100%; the subset reports 60%
    always_zero = torch.nn.Linear(1, 2)
    with torch.no_grad():
        always_zero.weight.zero_()
        always_zero.bias.copy_(torch.tensor([1.0, 0.0]))
    x = torch.randn(1000, 1)
    assert evaluate(always_zero, x, y, 32, torch.arange(100))[1] == 1.0
    assert evaluate(always_zero, x, y, 32, idx)[1] == pytest.approx(0.6)


def test_the_summary_states_how_a_capped_run_was_evaluated(tmp_path):
    summary = train(compose_config(["epochs=1", "progress=false", "max_steps_per_epoch=2", "max_eval_batches=1",
                                    "eval_batch_size=100"]), tmp_path)
    assert "stratified random subset of 100 of the 360 test examples" in summary["evaluation"]
    full = train(compose_config(["epochs=1", "progress=false", "max_steps_per_epoch=2"]), tmp_path / "full")
    assert full["evaluation"] == "the whole test split"


class TwoRanks:
    """A world of two ranks whose other rank's per-step counts are `other` ((k, 3)): all_reduce_ adds them."""

    def __init__(self, other):
        self.other = other

    def all_reduce_(self, tensors):
        for t in tensors:
            t += self.other


def test_divergence_is_judged_on_the_global_batch_not_a_ranks_share():
    """A rank whose share of a step is one record that is not finite (its loss and norm inf) must not end the run
    while the other rank's share is finite: one record would decide the outcome. Steps 21..23 here (checked at 23)."""
    from runner.train import finite_counts, finite_masks, first_diverged

    inf = float("inf")
    counted = lambda losses, norms: finite_counts(*finite_masks(torch.tensor(losses), torch.tensor(norms)))  # noqa: E731
    mine = [counted([inf], [inf]),  # step 21: my share is one bad record
            counted([1.0, 2.0], [0.5, 0.7]),  # step 22: fine
            counted([inf, inf], [inf, inf])]  # step 23: all bad here
    finite_elsewhere = torch.tensor([[3.0, 3.0, 3.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    assert first_diverged(TwoRanks(finite_elsewhere), [c.clone() for c in mine], 23) == 0
    bad_elsewhere = finite_elsewhere.clone()
    bad_elsewhere[2, 1:] = 0  # step 23: the other rank's share is not finite either
    assert first_diverged(TwoRanks(bad_elsewhere), [c.clone() for c in mine], 23) == 23
    empty_elsewhere = torch.zeros(3, 3, dtype=torch.float64)  # the other rank drew nothing: my share is the batch
    assert first_diverged(TwoRanks(empty_elsewhere), [c.clone() for c in mine], 23) == 21
    assert first_diverged(TwoRanks(empty_elsewhere), [], 23) == 0
