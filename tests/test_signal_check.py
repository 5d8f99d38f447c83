"""runner/signal_check.py: clipped signal vs the noise, exact vs JL (docs/imdb_reproduction.md, candidate 6)."""
from __future__ import annotations

import math

from runner import signal_check
from runner.paths import compose


def cfg(*extra):
    return compose(["dataset=synthetic", "dataset.like=imdb", "dataset.train_size=64", "dataset.test_size=8",
                    "dataset.seq_len=12", "model=bilstm", "model.hidden=4", "model.embed_dim=4", "model.dense=4",
                    "batch_size=16",
                    *extra])


def test_exact_signal_is_bounded_by_b_times_c_and_jl_lets_some_examples_through():
    # C = 0.1, below every norm here (~0.8-1.0), above a tenth of JL(1)'s estimates (|Z| ||g||, Z ~ N(0, 1))
    rows = signal_check.measure(cfg("clip=0.1", "sigma=1.0"), batches=2, rs=(1,))
    exact = [r for r in rows if r["method"] == "exact"]
    jl = [r for r in rows if r["method"] == "JL(1)"]
    assert len(exact) == len(jl) == 2
    for r in exact:  # every norm above the tiny clip: all clipped, the sum at most B*C
        assert r["unclipped"] == 0.0 and r["signal"] <= r["signal_bound"] * (1 + 1e-5)
        assert math.isclose(r["noise"], 1.0 * 0.1 * math.sqrt(r["d"]))
        assert math.isclose(r["snr"], r["signal"] / r["noise"])
    assert any(r["unclipped"] > 0 for r in jl)  # an estimate below C/... lets an example through whole
    rows = signal_check.measure(cfg("clip=1e6"), batches=1, rs=(1,))
    for r in rows:  # nothing clipped: the clipped sum is the batch gradient
        assert r["unclipped"] == 1.0 and r["cos_to_gradient"] > 0.9999
    table = signal_check.summary_table(rows)
    assert list(table["method"]) == ["exact", "JL(1)"]


def test_cli_prints_one_line_per_method(capsys):
    assert signal_check.main(["dataset=synthetic", "dataset.like=imdb", "dataset.train_size=32",
                              "dataset.test_size=8", "dataset.seq_len=8", "model=bilstm", "model.hidden=3", "model.embed_dim=3",
                              "model.dense=3", "batch_size=8", "+check.batches=1", "+check.r=1,2"]) == 0
    out = capsys.readouterr().out
    assert "signal_check: dataset=synthetic" in out
    assert all(name in out for name in ("exact", "JL(1)", "JL(2)"))
