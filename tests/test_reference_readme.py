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
    t3 = (tmp_path / "jl_table3.csv").read_text().splitlines()
    t3[1] = t3[1].replace(t3[1].split(",")[1], "999.0", 1)
    (tmp_path / "jl_table3.csv").write_text("\n".join(t3) + "\n")
    assert main(["--check", "--dir", str(tmp_path)]) == 1
    assert "999" in rewrite(tmp_path / "README.md", generated_section(tmp_path))
