"""Lee & Kifer's figures (fast per-example clipping): seconds per epoch by architecture (Figure 5), batch size
(Figure 6), MLP depth (Figure 7), ResNet/VGG on LSUN-shaped images (Figure 8), image size (Figure 9), and the
memory study (largest batch before out-of-memory, section 6.7; GPU only).

    python -m runner.plots lk_fig6 --scale smoke      # after: make fig-lk_fig6 (sweep + dprun-report)
"""
from __future__ import annotations

import pandas as pd

from runner.figures.spec import FIGURES, Figure, newest_per, seconds_per_epoch
from runner.figures.style import (LK_ORDER, MODEL_NAMES, bar_panel, finish, line_panel, lk_label, method_legend,
                                  model_name, panels, series_color, values)

DATA_TITLES = {"mnist": "MNIST", "fmnist": "FMNIST", "cifar10": "CIFAR10", "imdb": "IMDB", "lsun": "LSUN"}
MODEL_TITLES = {"mlp": "MLP", "cnn": "CNN", "rnn": "RNN", "lstm": "LSTM", "transformer": "Transformer"}
# Paper, section 6.7: the batch size at which each method first ran out of memory (ResNet-101, 256x256, 11 GB)
PAPER_MEMORY = {"Non-private": 48, "ReweightGP": 36, "multiLoss": 18}


def timing_table(runs, epochs, scale) -> pd.DataFrame:
    """One row per run: what it stands for (data, model, depth, batch, image size), method label, s/epoch."""
    runs = newest_per(runs, ["dataset", "like", "model", "depth", "batch_size", "image_size", "method", "r"])
    out = pd.DataFrame({
        "data": [l if d == "synthetic" and isinstance(l, str) else d for d, l in zip(runs["dataset"], runs["like"])],
        "data_source": ["synthetic" if d == "synthetic" else s for d, s in
                        zip(runs["dataset"], runs.get("data_source", pd.Series("real", index=runs.index)))],
        "model": runs["model"], "depth": runs["depth"], "batch_size": runs["batch_size"],
        "image_size": runs["image_size"],
        "label": [lk_label(m, r) for m, r in zip(runs["method"], runs["r"])],
        "s_per_epoch": seconds_per_epoch(runs).values, "peak_mem_bytes": runs["peak_mem_bytes"],
        "status": runs["status"],
    })
    nx = out[out["label"] == "nxBP"].set_index(["data", "model", "depth", "batch_size", "image_size"])["s_per_epoch"]
    keys = list(zip(out["data"], out["model"], out["depth"], out["batch_size"], out["image_size"]))
    out["speedup_vs_nxbp"] = [nx.get(k, float("nan")) / v if v else float("nan") for k, v in zip(keys, out["s_per_epoch"])]
    return out


def synthetic(data) -> bool:
    return values(data, "data_source") == ["synthetic"]


def data_title(data, d: str) -> str:
    """A panel's dataset as it ran: 'MNIST', or 'MNIST-shaped (synthetic)' for random tensors of its shape."""
    name = DATA_TITLES.get(d, d)
    return f"{name}-shaped (synthetic)" if synthetic(data[data["data"] == d]) else name


def ran(data, scale: str, *, model: bool = True) -> str:
    """The title's second line: what ran (model, data, batch size, scale), from the figure's table."""
    datasets = ", ".join(data_title(data, d) for d in values(data, "data")) or "?"
    parts = [f"ran: {model_name(data)} on {datasets}" if model else f"ran: {datasets} data",
             f"B={'/'.join(sorted(values(data, 'batch_size'), key=float)) or '?'}", f"scale={scale}"]
    return ", ".join(parts) + ("; synthetic tensors: timing only" if synthetic(data) else "")


def draw_fig5(data, caption, scale):
    sets = [d for d in ("mnist", "fmnist", "cifar10", "imdb") if d in set(data["data"])]
    fig, axes = panels(1, max(1, len(sets)), "Lee & Kifer Figure 5: seconds per epoch by architecture\n"
                       + ran(data, scale, model=False))
    for ax, d in zip(axes, sets):
        sub = data[data["data"] == d].assign(model=lambda t: t["model"].map(lambda m: MODEL_TITLES.get(m, m)))
        bar_panel(ax, sub, "model", "s_per_epoch", "label", data_title(data, d), order=LK_ORDER)
    method_legend(fig, axes)
    return finish(fig, caption)


def draw_fig6(data, caption, scale):
    models = [m for m in ("mlp", "cnn", "rnn") if m in set(data["model"])]
    fig, axes = panels(1, max(1, len(models)), "Lee & Kifer Figure 6: execution time by batch size\n"
                       + ran(data, scale, model=False).replace(", B=", ", batch sizes ").replace("/", ", "))
    for ax, m in zip(axes, models):
        line_panel(ax, data[data["model"] == m], "batch_size", "s_per_epoch", "label", MODEL_TITLES[m],
                   order=LK_ORDER, xlabel="batch size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(data.loc[data["model"] == m, "batch_size"].dropna())))
        ax.xaxis.set_major_formatter("{x:g}")
        ax.xaxis.set_minor_formatter("")
    method_legend(fig, axes)
    return finish(fig, caption)


def draw_fig7(data, caption, scale):
    sets = [d for d in ("mnist", "fmnist", "cifar10") if d in set(data["data"])]
    fig, axes = panels(1, max(1, len(sets)), "Lee & Kifer Figure 7: seconds per epoch by number of hidden layers\n"
                       + ran(data, scale))
    for ax, d in zip(axes, sets):
        line_panel(ax, data[data["data"] == d], "depth", "s_per_epoch", "label", data_title(data, d), order=LK_ORDER,
                   xlabel="hidden layers")
    method_legend(fig, axes)
    return finish(fig, caption)


def draw_fig8(data, caption, scale):
    sizes = sorted(int(s) for s in set(data["image_size"].dropna()))
    title = ("Lee & Kifer Figure 8: ResNet and VGG networks by image size; a missing bar: the run failed (out of "
             "memory)\n" + ran(data, scale) + "; image sizes " + ", ".join(f"{s} px" for s in sizes))
    for m in values(data, "model"):
        ran_at = sorted(int(s) for s in data.loc[data["model"] == m, "image_size"].dropna().unique())
        if ran_at != sizes:
            title += f"\n{MODEL_NAMES.get(m, m)} ran at {', '.join(f'{s} px' for s in ran_at)} only"
    fig, axes = panels(1, max(1, len(sizes)), title, 5.5)
    for ax, size in zip(axes, sizes):
        bar_panel(ax, data[data["image_size"] == size], "model", "s_per_epoch", "label", f"{size}x{size}",
                  order=LK_ORDER)
    method_legend(fig, axes)
    return finish(fig, caption)


def draw_fig9(data, caption, scale):
    sizes = sorted(int(s) for s in set(data["image_size"].dropna()))
    title = ("Lee & Kifer Figure 9: processing time by image resolution\n" + ran(data, scale)
             + f"; image sizes run: {', '.join(map(str, sizes))} px")
    if scale == "smoke" and 256 not in sizes:
        title += " (smoke: 256 px only at scale=paper)"
    fig, (ax, ratio) = panels(1, 2, title)
    line_panel(ax, data, "image_size", "s_per_epoch", "label", "seconds per epoch", order=LK_ORDER,
               xlabel="image size (pixels per side)")
    line_panel(ratio, data[data["label"] != "nxBP"], "image_size", "speedup_vs_nxbp", "label", "speed-up over nxBP",
               order=LK_ORDER, xlabel="image size (pixels per side)", ylabel="nxBP time / method time")
    ratio.axhline(1.0, color=series_color("nxBP"), ls="--", lw=0.8)
    ratio.annotate("nxBP", (0.01, 1.0), xycoords=("axes fraction", "data"), fontsize=7, color=series_color("nxBP"))
    method_legend(fig, [ax, ratio])
    return finish(fig, caption)


def memory_table(runs, epochs, scale) -> pd.DataFrame:
    if runs.empty:  # not run (GPU only, no CUDA): the paper's numbers, ours marked as not run
        return pd.DataFrame([{"label": label, "largest batch trained": None, "first batch that failed": None,
                              "largest batch tried": None, "peak memory GiB at largest": None,
                              "paper (11 GB GPU): first failed at": PAPER_MEMORY.get(label),
                              "status": "NOT RUN (GPU only; no CUDA on this machine)"}
                             for label in LK_ORDER if label in PAPER_MEMORY])
    probes = study_probes(runs)
    if probes is not None:
        return probes
    t = timing_table(runs, epochs, scale)
    rows = []
    for label, sub in t.groupby("label"):
        ok, failed = sub[sub["status"] == "finished"], sub[sub["status"] != "finished"]
        rows.append({"label": label, "largest batch trained": ok["batch_size"].max() if len(ok) else None,
                     "first batch that failed": failed["batch_size"].min() if len(failed) else None,
                     "largest batch tried": sub["batch_size"].max(),
                     "peak memory GiB at largest": (ok.sort_values("batch_size")["peak_mem_bytes"].iloc[-1] / 2**30
                                                    if len(ok) else None),
                     "paper (11 GB GPU): first failed at": PAPER_MEMORY.get(label)})
    return pd.DataFrame(rows)


def study_probes(runs) -> pd.DataFrame | None:
    """The bisection study's results (runner/memory_study.py), read from its probe.json files: per method the newest
    study that probed it. None when the runs are not probes (the old fixed grid, the test fixtures)."""
    import json
    from pathlib import Path

    dirs = [Path(d) for d in runs.get("run_dir", pd.Series(dtype=object)).dropna()]
    probe_dirs = [d for d in dirs if (d / "probe.json").exists()]
    if not probe_dirs:
        return None
    newest = {}  # method folder name -> the newest study folder holding it (study folders are named by time)
    for d in probe_dirs:
        study, method = d.parent.parent, d.parent.name
        if "@P" in method:  # <method>@P<P>: the same method with logical batches in chunks of P
            continue
        if method not in newest or study.name > newest[method].name:
            newest[method] = study
    rows = []
    for method, study in newest.items():
        probes = pd.DataFrame([json.loads(f.read_text()) for f in (study / method).glob("b*/probe.json")])
        ok, oom = probes[probes["status"] == "ok"], probes[probes["status"] == "oom"]
        best = ok.sort_values("batch_size").iloc[-1] if len(ok) else None
        cap = probes["memory_cap_bytes"].dropna() if "memory_cap_bytes" in probes else pd.Series(dtype=float)
        label = lk_label(method, None)
        rows.append({"label": label, "largest batch trained": int(best["batch_size"]) if best is not None else None,
                     "first batch that failed": int(oom["batch_size"].min()) if len(oom) else None,
                     "largest batch tried": int(probes["batch_size"].max()),
                     "peak memory GiB at largest": (best["peak_mem_bytes"] / 2**30 if best is not None
                                                    and pd.notna(best["peak_mem_bytes"]) else None),
                     "paper (11 GB GPU): first failed at": PAPER_MEMORY.get(label),
                     "probes": len(probes), "errors": int((probes["status"] == "error").sum()),
                     "memory cap GiB": float(cap.iloc[0]) / 2**30 if len(cap) else None,
                     **logical_columns(study, method),
                     "study": str(study)})
    return pd.DataFrame(rows)


def logical_columns(study, method: str) -> dict:
    """The largest logical batch that trained with physical_batch_size=P (the study's <method>@P<P> probes)."""
    import json

    folders = sorted(study.glob(f"{method}@P*"))
    if not folders:
        return {}
    probes = pd.DataFrame([json.loads(f.read_text()) for f in folders[-1].glob("b*/probe.json")])
    ok = probes[probes["status"] == "ok"] if len(probes) else probes
    return {"physical batch P": int(folders[-1].name.split("@P")[1]),
            "largest logical batch at P": int(ok["batch_size"].max()) if len(ok) else None,
            "logical batch failed at": (int(probes[probes["status"] == "oom"]["batch_size"].min())
                                        if (probes["status"] == "oom").any() else None)}


def draw_memory(data, caption, scale):
    fig, (ax,) = panels(1, 1, "Lee & Kifer section 6.7: largest batch before out-of-memory\n(the paper's setting: "
                        "ResNet-101 at 256x256 on an 11 GB GPU; ours: runner.memory_study)", 6)
    data = data.set_index("label").reindex([l for l in LK_ORDER if l in set(data["label"])])
    logical = pd.to_numeric(data.get("largest logical batch at P", pd.Series(dtype=float)), errors="coerce")
    width = 0.4 if logical.notna().any() else 0.8
    shift = -width / 2 if logical.notna().any() else 0.0
    ax.bar([i + shift for i in range(len(data))], pd.to_numeric(data["largest batch trained"], errors="coerce"),
           width=width, label="ours: the whole batch at once")
    if logical.notna().any():  # physical_batch_size=P: the logical batch is limited by the data set, not memory
        P = int(pd.to_numeric(data["physical batch P"], errors="coerce").dropna().iloc[0])
        ax.bar([i + width / 2 for i in range(len(data))], logical, width=width, hatch="//", color="tab:green",
               label=f"ours: logical batch in chunks of P={P} (physical_batch_size)")
        for i, v in enumerate(logical):
            if pd.notna(v):
                ax.annotate(f"{v:g}", (i + width / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log", base=2)  # the data set's size next to a one-pass batch of tens
    paper = pd.to_numeric(data["paper (11 GB GPU): first failed at"], errors="coerce")
    ax.scatter(range(len(data)), paper, color="k", marker="_", s=400,
               label="paper: first failed at (GTX 1080 Ti, 11 GB)", zorder=3)
    ax.set_xticks(range(len(data)), list(data.index))
    ax.set_ylabel("largest batch size trained")
    for i, (ok, bad) in enumerate(zip(pd.to_numeric(data["largest batch trained"], errors="coerce"),
                                      pd.to_numeric(data["first batch that failed"], errors="coerce"))):
        if pd.notna(ok):  # the bisection's bracket: the largest batch that fit, the first that ran out of memory
            ax.annotate(f"{ok:g}" + (f" (OOM at {bad:g})" if pd.notna(bad) else " (no OOM)"), (i + shift, ok),
                        ha="center", va="bottom", fontsize=8)
    cap = pd.to_numeric(data.get("memory cap GiB", pd.Series(dtype=float)), errors="coerce").dropna()
    if len(cap):
        ax.set_title(f"memory cap {cap.iloc[0]:.3g} GiB (memory_study.memory_cap_bytes)", fontsize=9)
    if pd.to_numeric(data["largest batch trained"], errors="coerce").isna().all():
        note = data["status"].dropna().iloc[0] if "status" in data and data["status"].notna().any() else "no runs"
        ax.text(0.5, 0.6, f"ours: {note}", transform=ax.transAxes, ha="center", va="center",
                fontsize=11, color="tab:red", bbox=dict(facecolor="white", edgecolor="tab:red"))
        ax.set_ylim(0, 64)
    if logical.notna().any():
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1, frameon=False)
    else:
        ax.legend(fontsize=7)
    return finish(fig, caption)


FIGURES.register("lk_fig5")(
    Figure("L&K", "Seconds per epoch by architecture", "figure", "lk_fig5", timing_table, draw_fig5))
FIGURES.register("lk_fig6")(
    Figure("L&K", "Execution time by batch size", "figure", "lk_fig6", timing_table, draw_fig6))
FIGURES.register("lk_fig7")(
    Figure("L&K", "Seconds per epoch by MLP depth", "figure", "lk_fig7", timing_table, draw_fig7))
FIGURES.register("lk_fig8")(
    Figure("L&K", "ResNet and VGG on LSUN-shaped images", "figure", "lk_fig8", timing_table, draw_fig8))
FIGURES.register("lk_fig9")(
    Figure("L&K", "Processing time by image resolution", "figure", "lk_fig9", timing_table, draw_fig9))
FIGURES.register("lk_memory")(
    Figure("L&K", "Largest batch before out-of-memory", "figure", "lk_memory", memory_table,
           draw_memory, gpu_only=True, keep_failed=True, study="runner.memory_study"))
