"""Numbers quoted in outputs/reference/README.md are generated from the committed CSVs beside it, never typed."""
from __future__ import annotations

from runner.figures.reference_readme import BEGIN, END, REFERENCE, generated_section, main, rewrite


def test_reference_readme_matches_the_committed_csvs():
    readme = (REFERENCE / "README.md").read_text()
    assert BEGIN in readme and END in readme
    assert main(["--check"]) == 0, "run: python -m runner.figures.reference_readme"


def test_a_changed_csv_makes_the_check_fail(tmp_path):
    import shutil

    for f in REFERENCE.glob("*.csv"):
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(REFERENCE / "README.md", tmp_path / "README.md")
    assert main(["--check", "--dir", str(tmp_path)]) == 0
    import pandas as pd

    t3 = pd.read_csv(tmp_path / "jl_table3.csv")
    t3.loc[0, "ours s/epoch"] = 999.0  # the number the README quotes (not the batch column)
    t3.to_csv(tmp_path / "jl_table3.csv", index=False)
    assert main(["--check", "--dir", str(tmp_path)]) == 1
    assert "999" in rewrite(tmp_path / "README.md", generated_section(tmp_path))
