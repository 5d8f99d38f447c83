"""runner/fp32_mode.py: the certified norms' float32 products whatever flags the user set before the step (issue 26).

A user's `torch.set_float32_matmul_precision("medium")` lets oneDNN round float32 matmul inputs to bf16 on the CPU,
and a library's `torch.backends.fp32_precision = "tf32"` (torch >= 2.9's new API; transformers' enable_tf32) made
the old TF32-off switch raise ("mix of the legacy and new APIs") on CUDA. No GPU is needed: the switches are
torch's global flags, which the CPU build keeps too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.fp32_mode import LEAVES, cpu_is_ieee, effective, float32_mode, tf32_enabled
from runner.methods import METHODS
from runner.norms.certify import exact_float32
from runner.precision import matmul_precision

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_get_fp32_precision_getter"), reason="torch < 2.9")

ALL_KEYS = [("generic", "all")] + [(b, o) for b in ("cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn")]


def raw():
    return {k: torch._C._get_fp32_precision_getter(*k) for k in ALL_KEYS}


def legacy():
    """The legacy flags where torch lets them be read (None: out of step with the new strings, reading raises)."""
    out = []
    for read in (torch.get_float32_matmul_precision, lambda: torch.backends.cudnn.allow_tf32,
                 lambda: torch.backends.cuda.matmul.allow_tf32):
        try:
            out.append(read())
        except RuntimeError:
            out.append(None)
    return tuple(out)


@pytest.fixture
def user_flags():
    """Every float32 flag put back after the test, whatever it set."""
    saved_legacy, saved_cudnn, saved_raw = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, raw()
    yield
    torch.set_float32_matmul_precision(saved_legacy)
    torch.backends.cudnn.allow_tf32 = saved_cudnn
    for key, value in saved_raw.items():
        torch._C._set_fp32_precision_setter(*key, value)


def _set_leaf(backend, op, value):
    return lambda: torch._C._set_fp32_precision_setter(backend, op, value)


USER_STATES = {  # what a user or a library may have set before dprun's step
    "default": lambda: None,
    "legacy allow_tf32": lambda: (setattr(torch.backends.cuda.matmul, "allow_tf32", True),
                                  setattr(torch.backends.cudnn, "allow_tf32", True)),
    "matmul precision high": lambda: torch.set_float32_matmul_precision("high"),
    "matmul precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    "new API generic tf32": _set_leaf("generic", "all", "tf32"),  # transformers' enable_tf32 on torch >= 2.9
    "new API cuda matmul tf32": _set_leaf("cuda", "matmul", "tf32"),
    "new API cudnn conv tf32": _set_leaf("cuda", "conv", "tf32"),
    "new API oneDNN bf16": _set_leaf("mkldnn", "all", "bf16"),
}


@pytest.mark.parametrize("state", list(USER_STATES))
def test_inside_the_products_are_what_was_asked_and_after_every_flag_is_as_the_user_left_it(user_flags, state):
    USER_STATES[state]()
    before_raw, before_legacy = raw(), legacy()
    with float32_mode("cuda", tf32=False):
        assert [effective(b, op) for b, op in LEAVES["cuda"]] == ["ieee"] * 3
        assert not tf32_enabled()
        assert None not in legacy() or None in before_legacy  # readable inside where it was before (Inductor reads it)
    assert (raw(), legacy()) == (before_raw, before_legacy)
    with float32_mode("cuda", tf32=True):  # a precision=tf32 step
        assert [effective(b, op) for b, op in LEAVES["cuda"]] == ["tf32"] * 3
        assert None not in legacy() or None in before_legacy
        step_state = raw(), legacy()
        with exact_float32(torch.device("cuda")):  # around a layer's norms and sums: TF32 paused
            assert [effective(b, op) for b, op in LEAVES["cuda"]] == ["ieee"] * 3
            assert None not in legacy() or None in before_legacy
            with exact_float32(torch.device("cuda")):  # nested: still off after the inner one ends
                pass
            assert not tf32_enabled()
        assert (raw(), legacy()) == step_state
    assert (raw(), legacy()) == (before_raw, before_legacy)
    with float32_mode("cpu"):  # oneDNN: "medium" or a "bf16" string would let it round float32 inputs to bf16
        assert [effective(b, op) for b, op in LEAVES["cpu"]] == ["ieee"] * 3
    assert (raw(), legacy()) == (before_raw, before_legacy)
    with exact_float32(torch.device("cuda")):  # what every certified norm and clipped sum runs under on CUDA
        assert not tf32_enabled()
    assert raw() == before_raw


def test_an_exception_inside_still_puts_the_flags_back(user_flags):
    torch.set_float32_matmul_precision("medium")
    before = raw(), legacy()
    with pytest.raises(ZeroDivisionError):
        with float32_mode("cpu"):
            1 / 0
    with pytest.raises(ZeroDivisionError):
        with float32_mode("cuda"):
            1 / 0
    assert (raw(), legacy()) == before


@pytest.mark.parametrize("precision", ["fp32", "bf16", "tf32"])
def test_a_private_step_on_the_cpu_takes_ieee_products_in_its_norms_whatever_the_user_set(user_flags, monkeypatch,
                                                                                         precision):
    """Failed before runner/fp32_mode.py: the norms ran with oneDNN's matmul in bf16 mode after the user's
    set_float32_matmul_precision("medium") (and the step left it so)."""
    import runner.methods.reweight as reweight
    import runner.norms.lean as lean

    seen = []
    real = reweight.certified_norms
    watched = lambda *a: seen.append([effective(b, op) for b, op in LEAVES["cpu"]]) or real(*a)  # noqa: E731
    monkeypatch.setattr(reweight, "certified_norms", watched)
    monkeypatch.setattr(lean, "certified_norms", watched)  # book-keeping's lean recorder: LeanRecorder.finish
    torch.set_float32_matmul_precision("medium")
    before = raw()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=0.0).configure(
        precision=precision, physical_batch_size=5)
    model = method.attach(model)
    method.clipped_sum(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y)
    # the first-step check (its probe rows as drawn and reversed, each at the run's clip and two small ones:
    # measured.py SMALL_FACTORS), then 3 chunks (5 + 5 + 2)
    assert len(seen) == 9 and seen == [["ieee"] * 3] * 9
    assert raw() == before and effective("mkldnn", "matmul") == "bf16"  # the user's setting, back after the step
    with matmul_precision(torch.device("cpu"), precision):
        assert effective("mkldnn", "matmul") == "ieee"


@pytest.mark.parametrize("state", list(USER_STATES))
def test_the_cpu_fast_path_is_taken_exactly_when_onednn_is_already_ieee(user_flags, state):
    USER_STATES[state]()
    ieee = all(effective(b, op) == "ieee" for b, op in LEAVES["cpu"])
    assert cpu_is_ieee() == ieee
    assert (matmul_precision(torch.device("cpu"), "fp32") is matmul_precision(torch.device("cpu"), "bf16")) == ieee
