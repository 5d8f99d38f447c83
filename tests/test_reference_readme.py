"""outputs/reference/README.md is generated, all of it, from the committed CSVs beside it and sources.csv (how each
file was made): never typed, so no sentence or number in it can go stale."""
from __future__ import annotations

import shutil

import pandas as pd

from runner.figures.reference_readme import BEGIN, END, REFERENCE, generated_section, main, readme_text, rewrite


def copy_reference(tmp_path):
    for f in [*REFERENCE.glob("*.csv"), REFERENCE / "README.md"]:
        shutil.copy(f, tmp_path / f.name)
    for f in REFERENCE.glob("*.png"):  # the README lists the PNGs here; their bytes do not matter
        (tmp_path / f.name).write_bytes(b"")
    return tmp_path


def test_reference_readme_is_what_the_committed_csvs_give():
    readme = (REFERENCE / "README.md").read_text()
    assert BEGIN in readme and END in readme
    assert readme == readme_text(REFERENCE), "run: python -m runner.figures.reference_readme"
    assert main(["--check"]) == 0


def test_a_changed_csv_makes_the_check_fail(tmp_path):
    ref = copy_reference(tmp_path)
    assert main(["--check", "--dir", str(ref)]) == 0
    t3 = pd.read_csv(ref / "jl_table3.csv")
    t3.loc[0, "ours s/epoch"] = 999.0  # the number the README quotes (not the batch column)
    t3.to_csv(ref / "jl_table3.csv", index=False)
    assert main(["--check", "--dir", str(ref)]) == 1
    assert "999" in rewrite(ref / "README.md", generated_section(ref))


def test_a_hand_edited_or_stale_opening_fails_the_check(tmp_path):
    """Issue 19: the opening described an earlier, incomplete run ("could not be completed", "0.41x") above tables
    of a complete one; the opening is generated too, from sources.csv and the CSVs."""
    ref = copy_reference(tmp_path)
    text = (ref / "README.md").read_text()
    opening = text.split(BEGIN)[0]
    (ref / "README.md").write_text(text.replace(opening, opening.replace("## What is here", "Edited by hand.\n\n"
                                                                         "## What is here")))
    assert main(["--check", "--dir", str(ref)]) == 1
    src = pd.read_csv(ref / "sources.csv", keep_default_na=False)
    src.loc[src["name"] == "jl_table3", "made_by"] = "another run"
    src.to_csv(ref / "sources.csv", index=False)
    assert main(["--dir", str(ref)]) == 0
    assert "| jl_table3 | another run |" in (ref / "README.md").read_text()


def test_the_opening_describes_the_files_here_and_their_runs():
    readme = (REFERENCE / "README.md").read_text()
    opening = readme.split("## Numbers")[0]
    src = pd.read_csv(REFERENCE / "sources.csv", keep_default_na=False)
    assert sorted(src["name"]) == sorted(p.stem for p in REFERENCE.glob("*.png"))  # every file's run recorded
    for made_by in set(src["made_by"]):
        assert made_by in opening
    for stale in ("could not be completed", "0.41x", "old data, new drawing"):
        assert stale not in readme


def test_headings_say_what_ran_from_the_csv():
    """'JL Table 2, CIFAR-10' over runs on synthetic CIFAR-10-shaped tensors: the headings name what ran."""
    readme = (REFERENCE / "README.md").read_text()
    t2 = pd.read_csv(REFERENCE / "jl_table2.csv")
    assert set(t2["dataset"].dropna()) == {"synthetic"}
    heading = next(line for line in readme.splitlines() if line.startswith("**JL Table 2"))
    assert "synthetic CIFAR-10-shaped data" in heading and "Papernot et al. CNN" in heading, heading
    fig3 = next(line for line in readme.splitlines() if line.startswith("**JL Figure 3"))
    assert "MLP on real digits" in fig3 and "MNIST" not in fig3, fig3


def test_import_and_redraw_keep_each_figures_caption(tmp_path, monkeypatch):
    """runner.plots records each caption (outputs/tables/captions.csv); --import copies the PNG, CSV and caption here;
    --redraw draws the PNG again from the CSV here with that caption."""
    from runner.figures import jl  # noqa: F401  (registers the figures)
    from runner.plots import save_caption

    ref, figures, tables = tmp_path / "ref", tmp_path / "figures", tmp_path / "tables"
    for d in (ref, figures, tables):
        d.mkdir()
    data = pd.DataFrame({"N": [60000] * 2, "B": [256] * 2, "sigma": [1.3] * 2, "r": ["No JL", "No JL"],
                         "epoch": [1, 2], "epsilon": [0.3, 0.4], "epsilon_lower_bound": [None, None]})
    data.to_csv(tables / "jl_epsilon_r.csv", index=False)
    (figures / "jl_epsilon_r.png").write_bytes(b"png")
    save_caption(tables, "jl_epsilon_r", "smoke", "JL: computed (test) | scale=smoke")
    (ref / "README.md").write_text("")
    assert main(["--dir", str(ref), "--import", "jl_epsilon_r", "--made-by", "make fig-x (test)",
                 "--figures", str(figures), "--tables", str(tables)]) == 0
    src = pd.read_csv(ref / "sources.csv", keep_default_na=False)
    assert src.loc[0, "caption"] == "JL: computed (test) | scale=smoke" and src.loc[0, "made_by"] == "make fig-x (test)"
    assert "| jl_epsilon_r | make fig-x (test) | runner.plots, with the run | smoke |" in (ref / "README.md").read_text()
    assert main(["--dir", str(ref), "--redraw", "jl_epsilon_r"]) == 0
    assert (ref / "jl_epsilon_r.png").read_bytes()[:4] == b"\x89PNG"
    assert "--redraw" in pd.read_csv(ref / "sources.csv", keep_default_na=False).loc[0, "drawn_by"]
    assert main(["--check", "--dir", str(ref)]) == 0
