"""runner/bench/overclip.py on real batches (--data-dir): the certified norms against nxBP's float64 ones, on training
examples read as a run reads them; a workload whose dataset is not in the folder is skipped with the reason."""
from __future__ import annotations

import pytest

from runner.bench import overclip
from runner.errors import DprunError
from test_data import tiny_idx, tiny_release  # noqa: F401  (the fixture: tiny files stand in for the release)


@pytest.mark.usefixtures("tiny_release")
def test_real_batches_are_read_and_the_certified_norms_sit_just_above_the_exact_ones(tmp_path, capsys):
    tiny_idx(tmp_path / "mnist")  # 12 training images, 28 x 28
    table = overclip.main(["--data-dir", str(tmp_path), "--batch", "4", "--workloads", "cnn_mnist,transformer_imdb"])
    out = capsys.readouterr().out
    assert "transformer_imdb: skipped" in out and "imdb" in out.split("transformer_imdb: skipped", 1)[1]
    assert list(table.workload.unique()) == ["cnn_mnist"] and set(table.data) == {"real"}
    assert set(table["mode"]) == set(overclip.MODES)
    assert (table.min_ratio_f32 >= 1).all(), table  # a certified norm is never below the computed gradient's
    assert (table.max_over < 1e-3).all() and (table.max_over_f32 < 1e-3).all(), table  # and only by the rounding


@pytest.mark.usefixtures("tiny_release")
def test_train_steps_train_first_and_need_real_data(tmp_path, capsys):
    tiny_idx(tmp_path / "mnist")
    table = overclip.main(["--data-dir", str(tmp_path), "--batch", "4", "--workloads", "lstm_mnist", "--train-steps", "3"])
    assert "lstm_mnist: 3 training steps, loss" in capsys.readouterr().out
    assert set(table.trained_steps) == {3} and (table.min_ratio_f32 >= 1).all(), table
    with pytest.raises(DprunError, match="--train-steps 3 needs --data-dir") as err:
        overclip.main(["--workloads", "lstm_mnist", "--train-steps", "3"])
    assert "\n" not in str(err.value)
