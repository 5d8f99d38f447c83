"""Each figure, drawn from the fixture tables, is checked as a reader would look at it (not only "a file exists"):
every plotted method is in a legend, a method has the one colour of runner.figures.style.METHOD_STYLE in every
figure, no axis is narrower than the data drawn on it, no bars on a log axis, chance-level panels say so, and every
DP-SBCD figure states N, B, sigma and delta."""
from __future__ import annotations

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgba
from matplotlib.lines import Line2D

from runner.figures import FIGURES
from runner.figures.style import METHOD_STYLE, method_key
from runner.plots import select_runs

from conftest import small_adaptive_noise

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUNS = pd.read_csv(FIXTURES / "runs.csv")
EPOCHS = pd.read_csv(FIXTURES / "runs_epochs.csv")

SLOW = {"jl_epsilon_r", "jl_fig7", "jl_table4"}  # accountant / bench: seconds to minutes; covered with -m slow
FIGS = [n for n in FIGURES.names() if FIGURES.get(n).kind == "figure" and n not in SLOW]


def draw(name):
    if name == "sbcd_adaptive_noise":  # it trains one DP-SBCD run per schedule: 2 epochs on synthetic data here
        with small_adaptive_noise():
            return _draw(name)
    return _draw(name)


def _draw(name):
    fig = FIGURES.get(name)
    runs = select_runs(RUNS, fig.experiment, "smoke", fig.keep_failed) if fig.experiment else RUNS.iloc[0:0]
    epochs = EPOCHS[EPOCHS["run_dir"].isin(set(runs["run_dir"]))] if fig.experiment else EPOCHS.iloc[0:0]
    return fig.draw(fig.table(runs, epochs, "smoke"), "caption", "smoke")


def plotted(figure):
    """(axes, artist, label) of every labelled artist drawn in data coordinates."""
    out = []
    for ax in figure.axes:
        for art in [*ax.lines, *ax.collections, *ax.containers]:
            label = art.get_label() if hasattr(art, "get_label") else None
            if label and not label.startswith("_"):
                out.append((ax, art, label))
    return out


def legend_texts(figure) -> set[str]:
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.axes if ax.get_legend()]
    return {t.get_text() for lg in legends for t in lg.get_texts()}


def colour_of(art):
    if isinstance(art, Line2D):
        return to_rgba(art.get_color())
    if isinstance(art, PathCollection):
        face, edge = art.get_facecolor(), art.get_edgecolor()  # face: the method; a red edge marks epsilon = inf
        return tuple(face[0]) if len(face) else tuple(edge[0])
    if isinstance(art, matplotlib.container.BarContainer):
        return art.patches[0].get_facecolor()
    return None


class Drawn(dict):
    """name -> its figure, drawn on first use: a test of one figure draws that one alone."""

    def __missing__(self, name):
        self[name] = draw(name)
        return self[name]

    def items(self):
        return [(name, self[name]) for name in FIGS]


@pytest.fixture(scope="session")
def drawn():
    """Each figure drawn once per worker (session scope: under xdist's worksteal a module fixture is set up again
    whenever a worker comes back to this module, and sbcd_adaptive_noise trains two runs)."""
    figures = Drawn()
    yield figures
    import matplotlib.pyplot as plt

    for f in figures.values():
        plt.close(f)


@pytest.mark.parametrize("name", FIGS)
def test_legend_holds_every_plotted_method(name, drawn):
    methods = {label for _, _, label in plotted(drawn[name]) if method_key(label)}
    assert methods <= legend_texts(drawn[name]), methods - legend_texts(drawn[name])


def test_a_method_has_one_colour_in_every_figure(drawn):
    seen: dict[str, set] = {}
    for name, figure in drawn.items():
        for _, art, label in plotted(figure):
            key, colour = method_key(label), colour_of(art)
            if key and colour is not None:
                seen.setdefault(key, set()).add((np.round(colour[:3], 3).tobytes(), name))
    assert seen, "no method drawn at all"
    for key, colours in seen.items():
        distinct = {c for c, _ in colours}
        assert len(distinct) == 1, f"{key} has {len(distinct)} colours: {sorted(n for _, n in colours)}"
        assert distinct == {np.round(to_rgba(METHOD_STYLE[key][0])[:3], 3).tobytes()}, key


@pytest.mark.parametrize("name", FIGS)
def test_no_axis_spans_less_than_its_data(name, drawn):
    for ax in drawn[name].axes:
        (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
        for art in [*ax.lines, *ax.collections]:
            if isinstance(art, Line2D) and art.get_transform() is ax.transData:
                xy = np.column_stack([np.asarray(art.get_xdata(), float), np.asarray(art.get_ydata(), float)])
            elif isinstance(art, PathCollection) and art.get_offset_transform() is ax.transData:
                xy = np.asarray(art.get_offsets(), float).reshape(-1, 2)
            else:
                continue
            xy = xy[np.isfinite(xy).all(axis=1)]
            if not len(xy):
                continue
            tol_x, tol_y = 1e-6 * max(1.0, abs(x1)), 1e-6 * max(1.0, abs(y1))
            assert xy[:, 0].min() >= x0 - tol_x and xy[:, 0].max() <= x1 + tol_x, (ax.get_title(), art.get_label())
            assert xy[:, 1].min() >= y0 - tol_y and xy[:, 1].max() <= y1 + tol_y, (ax.get_title(), art.get_label())


@pytest.mark.parametrize("name", FIGS)
def test_no_bars_on_a_log_axis(name, drawn):
    for ax in drawn[name].axes:
        if ax.get_yscale() == "log":
            assert not any(isinstance(c, matplotlib.container.BarContainer) for c in ax.containers), ax.get_title()


def all_text(figure) -> str:
    texts = [t.get_text() for t in figure.texts] + [figure._suptitle.get_text() if figure._suptitle else ""]
    for ax in figure.axes:
        texts += [ax.get_title(), *[t.get_text() for t in ax.texts]]
    return "\n".join(texts)


@pytest.mark.parametrize("name", ["jl_fig1", "jl_fig4", "jl_fig5", "jl_fig6"])
def test_chance_level_panels_say_so(name, drawn):
    """The fixture's JL Table 2/3 runs are synthetic (random labels): the panels must say accuracy is chance."""
    text = all_text(drawn[name])
    assert "chance" in text and "synthetic" in text.lower()
    assert "ran:" in text  # the title names what actually ran


def test_real_data_panels_do_not_claim_chance(drawn):
    assert "chance" not in all_text(drawn["jl_fig3"])  # digits: real labels


@pytest.mark.parametrize("name", [n for n in FIGS if n.startswith("sbcd_")])
def test_every_sbcd_figure_states_n_b_sigma_delta(name, drawn):
    text = all_text(drawn[name])
    for needle in ("N=", "B=", "sigma", "delta"):
        assert needle in text, needle


def test_sbcd_adaptive_noise_has_separate_axes_and_a_trained_utility_panel(drawn):
    figure = drawn["sbcd_adaptive_noise"]
    labels = [ax.get_ylabel() for ax in figure.axes]
    assert any("epsilon" in lab for lab in labels) and any("sigma" in lab for lab in labels)
    assert not any("epsilon" in lab and "sigma" in lab for lab in labels)
    utility = next(ax for ax in figure.axes if ax.get_ylabel() == "test accuracy")
    legend = [t.get_text() for t in utility.get_legend().get_texts()]
    assert len(legend) == 2 and all("certified" in t and "assumed" in t for t in legend)  # both epsilons named
    assert {t.split(":")[0] for t in legend} == {"constant", "adaptive"}
    assert all(len(line.get_xdata()) == 2 for line in utility.get_lines())  # one point per trained epoch
    assert "chance" in all_text(figure)  # synthetic labels here: the panel says so


def test_log_ticks_are_plain_and_few(drawn):
    for name, figure in drawn.items():
        figure.canvas.draw()
        for ax in figure.axes:
            for axis in (ax.xaxis, ax.yaxis):
                if axis.get_scale() != "log":
                    continue
                labels = [t.get_text() for t in axis.get_ticklabels() if t.get_text()]
                labels += [t.get_text() for t in axis.get_minorticklabels() if t.get_text()]
                assert len(labels) <= 12, (name, labels)
                assert not any("times" in lab for lab in labels), (name, labels)


def test_figures_list_gives_a_paper_scale_gpu_estimate_for_every_target(capsys):
    from runner.figures.gpu_time import PAPER_GPU_HOURS
    from runner.plots import main

    assert set(FIGURES.names()) <= set(PAPER_GPU_HOURS)
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "GPU time at scale=paper" in out and "total at scale=paper" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_computed_figures_render(name, tmp_path):
    from runner.plots import render

    result = render(name, RUNS, EPOCHS, "smoke", tmp_path / "f", tmp_path / "t", formats=("png",))
    assert not isinstance(result, str), result
    assert len(pd.read_csv(tmp_path / "t" / f"{name}.csv")) > 0


def test_dprun_multirun_of_a_preset_with_extra_sweeps_names_the_make_target(monkeypatch):
    from runner.cli import extra_sweeps_note

    monkeypatch.delenv("DPRUN_FIGURE_SWEEP", raising=False)
    note = extra_sweeps_note(["-m", "experiment=jl_table2", "scale=paper"])
    assert note and "make fig-jl_table2 SCALE=paper" in note and "\n" not in note
    assert extra_sweeps_note(["-m", "experiment=lk_fig6"]) is None  # no extra sweeps
    assert extra_sweeps_note(["experiment=jl_table2"]) is None  # a single run
    monkeypatch.setenv("DPRUN_FIGURE_SWEEP", "1")
    assert extra_sweeps_note(["-m", "experiment=jl_table2"]) is None  # the figure sweep runs them itself


def test_the_infinite_epsilon_marker_is_no_methods_colour():
    """The epsilon = inf edge was tab:red, which is also nxBP's (DP-SGD-Vanilla's) colour: its finite-epsilon markers
    read as 'no guarantee' in jl_fig3."""
    from runner.figures.style import INF_EDGE, METHOD_STYLE

    assert all(to_rgba(colour) != to_rgba(INF_EDGE) for colour, _ in METHOD_STYLE.values())


def test_log_ticks_label_only_powers_of_ten_over_many_decades():
    """jl_fig5's time axis spans 2 s to 2,000 s: 1-2-5 labels at every decade ran into each other."""
    import matplotlib.pyplot as plt

    from runner.figures.style import plain_log_axis

    labels = {}
    for lo, hi in [(2, 2000), (0.3, 8)]:
        fig, ax = plt.subplots()
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        plain_log_axis(ax.xaxis)
        fig.canvas.draw()
        fmt = ax.xaxis.get_major_formatter()
        labels[(lo, hi)] = [fmt(x) for x in ax.xaxis.get_majorticklocs() if lo <= x <= hi and fmt(x)]
        plt.close(fig)
    assert labels[(2, 2000)] == ["10", "100", "1000"]
    assert labels[(0.3, 8)] == ["0.5", "1", "2", "5"]


def trajectory_table(model: str, dataset: str, like=None, batch=64, lrs=None) -> pd.DataFrame:
    """A figure CSV of accuracy-vs-time runs (as runner.figures.jl.trajectories writes it) for one model and data."""
    lrs = lrs or {"nonprivate": 0.2, "nxbp": 0.5, "jl": 0.5}
    rows = []
    for method, label, eps in (("nonprivate", "Non-DP SGD", None), ("nxbp", "DP-SGD-Vanilla", 1.0),
                               ("jl", "DP-SGD-JL(1)", float("inf"))):
        for epoch, acc in ((1, 0.7), (2, 0.85)):
            rows.append({"label": label, "method": method, "r": 1 if method == "jl" else None, "epoch": epoch,
                         "time_s": epoch * 0.5, "test_acc": acc + (0.1 if method == "nonprivate" else 0.0),
                         "epsilon": eps, "run_dir": f"x/{method}", "dataset": dataset, "like": like, "model": model,
                         "batch_size": batch, "sigma": None if method == "nonprivate" else 1.3,
                         "lr": lrs[method], "time_basis": "estimated"})
    return pd.DataFrame(rows)


def suptitle(figure) -> str:
    return figure._suptitle.get_text()


def test_titles_say_what_ran_not_the_papers_setting():
    """Issue 19: JL Figure 3's title said "2-layer CNN on MNIST ... 95%" over a run of an MLP on digits. Every
    trained figure's title is drawn from its own CSV: the model, the data, B, the scale (and each lr)."""
    import matplotlib.pyplot as plt

    digits = trajectory_table("mlp", "digits")
    for name in ("jl_fig3", "jl_fig4", "jl_fig1", "jl_fig5", "jl_fig6"):
        fig = FIGURES.get(name).draw(digits, "caption", "smoke")
        title = suptitle(fig)
        plt.close(fig)
        assert "MLP on real digits" in title and "B=64" in title and "scale=smoke" in title, (name, title)
        for paper in ("2-layer CNN", "MNIST", "CIFAR", "IMDB", "BiLSTM", "Papernot", "95%", "55%", "70%"):
            assert paper not in title, (name, paper, title)
        assert "lr 0.5 (Non-DP SGD: 0.2)" in title, title  # the baseline's own learning rate, stated
    mnist = trajectory_table("bu_cnn", "mnist", batch=256, lrs={"nonprivate": 0.05, "nxbp": 0.25, "jl": 0.25})
    fig = FIGURES.get("jl_fig3").draw(mnist, "caption", "paper")
    assert "2-layer CNN (bu_cnn) on real MNIST, B=256" in suptitle(fig) and "scale=paper" in suptitle(fig)
    assert "time and epsilon at accuracy 0.95" in fig.axes[1].get_title() or \
        "time and epsilon at accuracy 0.95" in all_text(fig)
    plt.close(fig)


def test_seconds_tables_and_lee_kifer_titles_come_from_their_csv():
    import matplotlib.pyplot as plt

    table = pd.DataFrame({"method": ["Non-DP SGD", "DP-SGD-JL(1)"], "ours B": [32, 32],
                          "dataset": ["synthetic", "synthetic"], "like": ["mnist", "mnist"],
                          "model": ["vgg13", "vgg13"], "ours s/epoch": [1.0, 2.0], "ours / non-private": [1.0, 2.0],
                          "paper PyTorch": [13, 212], "paper TensorFlow": [12, 20]})
    for name in ("jl_table2", "jl_table5"):
        fig = FIGURES.get(name).draw(table, "caption", "smoke")
        title = fig.axes[0].get_title()
        plt.close(fig)
        assert "VGG-13 on synthetic MNIST-shaped data, B=32" in title and "scale=smoke" in title, title
        assert "CIFAR" not in title and "Papernot" not in title and "256" not in title, title
    depth = pd.DataFrame({"data": ["mnist"] * 4, "data_source": ["real"] * 4, "model": ["mlp"] * 4,
                          "depth": [2, 2, 4, 4], "batch_size": [64] * 4, "image_size": [None] * 4,
                          "label": ["Non-private", "nxBP"] * 2, "s_per_epoch": [1.0, 5.0, 2.0, 9.0],
                          "peak_mem_bytes": [1e8] * 4, "status": ["finished"] * 4, "speedup_vs_nxbp": [5, 1, 4.5, 1]})
    fig = FIGURES.get("lk_fig7").draw(depth, "caption", "paper")
    title, panel = suptitle(fig), fig.axes[0].get_title()
    plt.close(fig)
    assert "MLP on MNIST, B=64, scale=paper" in title and "B=128" not in title and panel == "MNIST", (title, panel)
    synthetic = depth.assign(data_source="synthetic")
    fig = FIGURES.get("lk_fig5").draw(synthetic[synthetic["depth"] == 2].assign(model="cnn"), "caption", "smoke")
    assert "B=32" not in suptitle(fig) and "B=64" in suptitle(fig) and "synthetic" in suptitle(fig)
    assert fig.axes[0].get_title() == "MNIST-shaped (synthetic)"
    plt.close(fig)


def test_a_sweep_that_shares_one_seed_is_told_it_shares_the_noise(monkeypatch):
    """rng=seeded jobs with one seed draw the same noise: an lr sweep's models published together cancel it."""
    from runner.cli import shared_seed_note

    monkeypatch.delenv("DPRUN_FIGURE_SWEEP", raising=False)
    assert "draw the same noise" in shared_seed_note(["-m", "method=reweight", "lr=0.1,0.2"])
    assert "draw the same noise" in shared_seed_note(["-m", "experiment=jl_fig3"])
    assert shared_seed_note(["-m", "lr=0.1,0.2", "seed=0,1"]) is None  # the seed is swept too
    assert shared_seed_note(["-m", "lr=0.1,0.2", "rng=secure"]) is None
    assert shared_seed_note(["lr=0.1"]) is None  # one run
    monkeypatch.setenv("DPRUN_FIGURE_SWEEP", "1")
    assert shared_seed_note(["-m", "lr=0.1,0.2"]) is None  # a figure's sweep


def lowest_value_has_a_tick_below(ax) -> bool:
    """On a log y axis: the lowest plotted value lies above a visible major tick, or less than a decade below the
    lowest one (a wide range ticks every other decade, and the lowest curve could sit far below the first label,
    unreadable)."""
    values = [np.asarray(line.get_ydata(), float) for line in ax.lines if line.get_transform() is ax.transData]
    values = np.concatenate(values) if values else np.array([])
    values = values[np.isfinite(values) & (values > 0)]
    if not len(values) or ax.get_yscale() != "log":
        return True
    y0, y1 = sorted(ax.get_ylim())
    ticks = [t for t in ax.get_yticks() if y0 * (1 - 1e-9) <= t <= y1 * (1 + 1e-9)]
    return bool(ticks) and values.min() * 10 > min(ticks)


@pytest.mark.parametrize("name", FIGS)
def test_every_log_axis_has_a_tick_below_its_lowest_value(name, drawn):
    for ax in drawn[name].axes:
        assert lowest_value_has_a_tick_below(ax), ax.get_title()


def test_jl_epsilon_r_reads_its_lowest_curve():
    """The reference table's right panel (epsilon from 4 to 1e12) ticked 1e2, 1e4, ... and its No-JL curve (4-6)
    sat below every label."""
    import matplotlib.pyplot as plt

    data = pd.read_csv(Path(__file__).resolve().parents[1] / "outputs" / "reference" / "jl_epsilon_r.csv")
    figure = FIGURES.get("jl_epsilon_r").draw(data, "caption", "smoke")
    try:
        figure.canvas.draw()
        assert len(figure.axes) == 2
        for ax in figure.axes:
            assert lowest_value_has_a_tick_below(ax), ax.get_title()
    finally:
        plt.close(figure)


def test_an_epsilon_axis_states_the_runs_delta_and_runs_at_another_delta_are_left_out():
    """Review 43: jl_fig3 drew a run at delta 0.01 under a hard-coded delta 10^-5 (0.257 where 10^-5 needs 0.984),
    and a run at another delta was kept beside the others. delta (and sampling, accountant) are figure settings now:
    the run at another delta is left out and named; the colour bar and the epsilon axis state the delta drawn."""
    from runner.figures.style import delta_tex

    mine = RUNS[(RUNS["experiment"] == "jl_fig3") & (RUNS["scale"] == "smoke")].copy()
    at_001 = mine.assign(delta=0.01)
    notes: list[str] = []
    runs = select_runs(at_001, "jl_fig3", "smoke", notes=notes)
    fig = FIGURES.get("jl_fig3")
    epochs = EPOCHS[EPOCHS["run_dir"].isin(set(runs["run_dir"]))]
    drawn = fig.draw(fig.table(runs, epochs, "smoke"), "caption", "smoke")
    labels = [ax.get_ylabel() for ax in drawn.axes]
    matplotlib.pyplot.close(drawn)  # (a figure left open counts toward matplotlib's 20, a warning in other tests)
    assert any("10^{-2}" in t for t in labels) and not any("10^{-5}" in t for t in labels), labels
    # one run of the preset at another delta, the newest: the larger set stays and the odd one is named
    mixed = mine.copy()
    mixed.loc[mixed.index[0], "delta"] = 0.01
    notes = []
    kept = select_runs(mixed, "jl_fig3", "smoke", notes=notes)
    assert len(kept) == len(mine) - 1 and "delta=0.01" in " ".join(notes), notes
    with pytest.raises(Exception, match="different deltas"):
        delta_tex(pd.DataFrame({"delta": [1e-5, 1e-2]}))
    assert delta_tex(pd.DataFrame({"delta": [1e-5, None]})) == "$\\delta=10^{-5}$"
