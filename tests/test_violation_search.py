"""The search for a certified-clipping violation (runner/bench/violation_search.py, issue 26): it must find the hole
the contract was written for when the hole is put back (the float32 ghost Gram; the masked second pass skipped), find
the Opacus peer's uncertified ghost excess, drive the exact gradient towards cancellation on its own, and find
nothing on today's rules: a short search over every construction x setting here, two full rounds under -m slow."""
from __future__ import annotations

import math

import pytest
import torch

from runner.bench import violation_search as vs
from runner.bench.adversarial import CONSTRUCTIONS, exact_norm
from runner.errors import DprunError
from runner.norms import certify, outer

CASES = [case for case, _, _ in vs.SEARCHED]


def float32_ghost(aa, gg, k, o, u):
    """The ghost norm as it was before issue 26: the float32 Gram sum, no bound on what its rounding hides."""
    return (aa * gg).sum(2).sum(1).clamp_min(0), None


def quiet(_line):
    pass


def test_the_search_finds_the_float32_ghost_hole_when_it_is_put_back(monkeypatch):
    monkeypatch.setattr(outer, "ghost_parts", float32_ghost)
    table = vs.search(["linear512_T16", "conv2d_64x256_8x8"], ["bk ghost"], restarts=1, progress=quiet)
    assert len(table) == 2 and (table.worst > 1 + vs.TOL).all(), table.to_string()
    assert table.set_index("case").worst["linear512_T16"] > 10  # ~100 x C: the measurement


def test_the_search_finds_the_uncertified_opacus_ghost_excess():
    table = vs.search(["linear512_T16"], ["opacus ghost (timed only)"], restarts=1, progress=quiet)
    row = table.iloc[0]
    assert row.worst > 1 + vs.TOL and not row.promises


def test_the_search_finds_a_release_turned_nan_when_the_masked_pass_is_skipped(monkeypatch):
    """Each restart's best input is measured again beside a record of inf and one of nan inputs: with book-keeping's
    masked second pass skipped (every record taken as kept), 0 * nan reaches the release, which is a violation."""
    monkeypatch.setattr(certify, "every_record_kept", lambda keep, started=None: True)
    table = vs.search(["linear512_T16"], ["bk direct"], restarts=1, steps=1, climbs=0, progress=quiet)
    assert table.worst.iloc[0] == math.inf and table["where"].iloc[0][1].startswith("beside"), table.to_string()


def test_descent_drives_the_exact_gradient_to_cancellation():
    """The gradient-guided move alone: ||G(x)|| / ||x|| falls by >= 1000x within 8 steps on a Linear and a conv."""
    for case in ("linear512_T16", "conv2d_32x64_16x16_groups"):
        build, example = next((b, e) for cs in CONSTRUCTIONS.values() for c, b, e in cs if c == case)
        model, x = build(0), example(torch.Generator().manual_seed(0), 1e-2)
        start = exact_norm(model, x) / float(x.norm())
        iterates = list(vs.descent(model, x, 8))
        assert iterates and all(math.isclose(float(z.norm()), float(x.norm()), rel_tol=1e-5) for z in iterates)
        assert exact_norm(model, iterates[-1]) / float(iterates[-1].norm()) < start / 1000, case


@pytest.mark.parametrize("case", CASES)
def test_a_short_search_finds_no_violation(case):
    """One restart per setting, 4 descent steps and 2 climbs: every setting that promises the bound keeps it."""
    table = vs.search([case], None, restarts=1, steps=4, climbs=2, progress=quiet)
    assert set(table.setting) == set(vs.settings_for("cpu")) and (table.evaluations >= 1).all()
    assert table[table.promises].worst.notna().all(), table.to_string()  # a refusal (nan) would hide a setting
    bad = table[table.promises & (table.worst > 1 + vs.TOL)]
    assert bad.empty, bad.to_string()


@pytest.mark.slow
def test_every_setting_on_every_rule_survives_two_rounds():
    table = vs.search(restarts=2, progress=quiet)
    assert len(table) == len(CASES) * len(vs.settings_for("cpu"))
    bad = table[table.promises & (table.worst > 1 + vs.TOL)]
    assert bad.empty, bad.to_string()


def test_the_command_exits_1_on_a_violation_and_0_without(tmp_path, monkeypatch, capsys):
    args = ["--restarts", "1", "--cases", "linear512_T16", "--settings", "bk ghost", "--out", str(tmp_path)]
    assert vs.main(args) == 0
    assert (tmp_path / "search_cpu.csv").exists()
    monkeypatch.setattr(outer, "ghost_parts", float32_ghost)
    assert vs.main(args) == 1
    assert "VIOLATION" in capsys.readouterr().out


def test_settings_with_commas_inside_their_parentheses_are_one_setting(tmp_path, capsys):
    assert vs.main(["--restarts", "1", "--cases", "linear512x256_one_position", "--settings",
                    "reweight (defaults: bk, auto),bk bf16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reweight (defaults: bk, auto)" in out and "bk bf16" in out


def test_an_unknown_case_is_one_line():
    with pytest.raises(DprunError, match=r"nothing to search.*valid cases: linear512_T16") as err:
        vs.search(["linear9"], None, restarts=1, progress=quiet)
    assert "\n" not in str(err.value)
