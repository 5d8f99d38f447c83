"""dprun-report's printed table (issue 28): it fits 120 columns (--wide shows every column), shows the scale columns
(precision, physical_batch_size, world_size), and leaves blanks, never `None`, where a run has no value."""
from __future__ import annotations

from runner.report import main
from tests.test_report import make_run


def printed(tmp_path, capsys, *flags) -> list[str]:
    root = tmp_path / "outputs"
    make_run(root / "runs" / "2026-01-01" / "a_long_folder_name_for_a_nonprivate_run", "nonprivate",
             extra={"method.mode": "bk", "precision": "fp32", "physical_batch_size": None,
                    "distributed.nproc_per_node": 1})
    make_run(root / "multirun" / "2026-01-01" / "s" / "0_method=reweight,physical_batch_size=64", "reweight",
             experiment="lk_memory", extra={"method.mode": "bk", "method.norm": "auto", "precision": "bf16",
                                            "physical_batch_size": 64})
    assert main(["--root", str(root), *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    return out[:out.index(next(ln for ln in out if ln.startswith("dprun-report: ")))]


def test_the_default_table_fits_120_columns_with_the_scale_columns_and_blanks(tmp_path, capsys):
    lines = printed(tmp_path, capsys)
    assert max(map(len, lines)) <= 120, "\n".join(lines)
    header = lines[0].split()
    assert {"precision", "phys_B", "ranks"} <= set(header), header
    assert "None" not in "\n".join(lines) and "nan" not in "\n".join(lines).lower()
    reweight = next(ln for ln in lines if " reweight " in f" {ln} ")
    assert " bf16 " in reweight and " 64 " in reweight


def test_wide_shows_every_column(tmp_path, capsys):
    lines = printed(tmp_path, capsys, "--wide")
    header = lines[0].split()
    for col in ("experiment", "scale", "method_options", "physical_batch_size", "world_size", "sampling", "delta",
                "device", "folder"):
        assert col in header, col
    assert "None" not in "\n".join(lines)


def test_the_default_table_keeps_the_end_of_a_long_folder(tmp_path, capsys):
    """Cut to 22 characters from the start, a sweep's folders (multirun/<date>/<time>/<job>) all read the same;
    the end, the job's own name, tells them apart (the CSV and --wide have the whole path)."""
    text = "\n".join(printed(tmp_path, capsys))
    assert "…hysical_batch_size=64" in text
    assert "…_for_a_nonprivate_run" in text
