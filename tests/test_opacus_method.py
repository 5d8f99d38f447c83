"""method=opacus: Opacus 1.6 (hooks | functorch | ghost) computes per-example gradients or norms; our clip and sum
must then equal nxBP's. Without Opacus installed, a one-line error names the extra."""
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.data.base import DataInfo
from runner.errors import DprunError
from runner.methods import METHODS
from runner.models import MODELS

MODES = ["hooks", "functorch", "ghost"]
IMDB = DataInfo("imdb", (6,), 2, kind="text", vocab_size=12)
SMALL = {  # models Opacus handles in every mode (no layer called twice, no padding_idx)
    "mlp": (DataInfo("mnist", (1, 4, 4), 10), dict(widths=(6, 5))),
    "bu_cnn": (DataInfo("mnist", (1, 16, 16), 10), dict(widths=(3, 4), hidden=5)),
    "transformer": (DataInfo("mnist", (1, 5, 4), 10), dict(d_model=8, heads=2, ff=6, dropout=0.0)),
}


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def inputs(info, B, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, info.num_classes, (B,), generator=g)
    if info.kind == "text":
        return torch.randint(1, info.vocab_size, (B, *info.input_shape), generator=g), y
    return torch.randn(B, *info.input_shape, generator=g, dtype=torch.float64), y


def clipped(method, model, x, y):
    for p in model.parameters():
        p.grad = None
    out = method.privatize(model, loss_fn, x, y)
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SMALL))
def test_clipped_sum_equals_nxbp_float64(name, mode):
    pytest.importorskip("opacus")
    info, kw = SMALL[name]
    torch.manual_seed(0)
    model = MODELS.build(name, info, **kw).double()
    x, y = inputs(info, 5)
    want, want_g = clipped(METHODS.build("nxbp", clip=0.3), model, x, y)
    method = METHODS.build("opacus", cfg={"grad_sample_mode": mode, "uncertified_ok": True}, clip=0.3)
    assert method.attach(model) is model
    for _ in range(2):  # the second step must not see the first step's grad samples / norms
        got, got_g = clipped(method, model, x, y)
        torch.testing.assert_close(got.norms, want.norms, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got.losses, want.losses)
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert (want.norms > 0.3).any()


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_recurrent_and_text_models_in_hooks_modes(mode):
    """A Linear called once per time step: Opacus sums its grad samples over the calls before the norm."""
    pytest.importorskip("opacus")
    model = MODELS.build("lstm", IMDB, hidden=4, embed_dim=3).double()
    x, y = inputs(IMDB, 4)
    want, want_g = clipped(METHODS.build("nxbp", clip=0.5), model, x, y)
    method = METHODS.build("opacus", cfg={"grad_sample_mode": mode}, clip=0.5)
    got, got_g = clipped(method, method.attach(model), x, y)
    torch.testing.assert_close(got.norms, want.norms)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_float32_within_float_tolerance():
    pytest.importorskip("opacus")
    info, kw = SMALL["bu_cnn"]
    model = MODELS.build("bu_cnn", info, **kw)
    x, y = inputs(info, 6)
    x = x.float()
    want, want_g = clipped(METHODS.build("nxbp", clip=0.3), model, x, y)
    method = METHODS.build("opacus", cfg={"grad_sample_mode": "ghost", "uncertified_ok": True}, clip=0.3)
    got, got_g = clipped(method, method.attach(model), x, y)
    torch.testing.assert_close(got.norms, want.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ghost_rejects_a_layer_called_twice_in_one_line():
    pytest.importorskip("opacus")
    model = MODELS.build("rnn", IMDB, hidden=4, embed_dim=3).double()
    method = METHODS.build("opacus", cfg={"grad_sample_mode": "ghost", "uncertified_ok": True})
    with pytest.raises(DprunError, match=r"^method=opacus grad_sample_mode=ghost fails on RecurrentClassifier: "
                                         r"Parameter tying is not supported with Ghost Clipping$"):
        clipped(method, method.attach(model), *inputs(IMDB, 2))


@pytest.mark.parametrize("mode", MODES)
def test_prepare_keeps_the_model_and_its_state_dict(mode):
    pytest.importorskip("opacus")
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    keys = list(model.state_dict())
    method = METHODS.build("opacus", cfg={"grad_sample_mode": mode, "uncertified_ok": True})
    assert method.attach(model) is model and list(model.state_dict()) == keys
    method.hooks.cleanup()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_train_step():  # the empty batch: tests/test_method_contract.py
    pytest.importorskip("opacus")
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    method = METHODS.build("opacus", clip=1.0, sigma=0.0)
    method.attach(model)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    before = [p.detach().clone() for p in model.parameters()]
    _, want_g = clipped(METHODS.build("nxbp", clip=1.0), model, x, y)
    method.step(model, loss_fn, x, y, torch.optim.SGD(model.parameters(), lr=1.0), sample_rate=0.5,
                expected_batch_size=8.0)
    for p0, g, p in zip(before, want_g, model.parameters()):
        torch.testing.assert_close(p.detach(), p0 - g / 8.0)


def test_eval_mode_and_unprepared_models_are_one_line_errors():
    pytest.importorskip("opacus")
    model = nn.Linear(3, 2)
    method = METHODS.build("opacus")
    with pytest.raises(DprunError, match="call method.attach|step a model returned by method.attach"):
        clipped(method, model, torch.randn(2, 3), torch.tensor([0, 1]))
    method.attach(model)
    model.eval()
    with pytest.raises(DprunError, match="train mode"):
        clipped(method, model, torch.randn(2, 3), torch.tensor([0, 1]))


def test_unknown_mode_names_the_valid_ones():
    with pytest.raises(DprunError, match=r"^unknown method.grad_sample_mode 'ew' for method=opacus; valid: hooks, ghost, functorch$"):
        METHODS.build("opacus", cfg={"grad_sample_mode": "ew"})


def test_without_opacus_the_error_names_the_extra(monkeypatch):
    for mod in [m for m in sys.modules if m == "opacus" or m.startswith("opacus.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "opacus", None)  # `import opacus` now raises ImportError
    with pytest.raises(DprunError) as e:
        METHODS.build("opacus").attach(nn.Linear(3, 2))
    assert str(e.value) == "method=opacus needs Opacus: pip install 'dprun[peers]' (or -e '.[peers]' in a checkout)"


class _Head(nn.Module):
    """layer -> (first output if a tuple) -> tanh -> flatten -> Linear(width, 3)."""

    def __init__(self, layer: nn.Module, width: int, two_inputs: bool = False):
        super().__init__()
        self.layer, self.head, self.two_inputs = layer, nn.Linear(width, 3), two_inputs

    def forward(self, x):
        out = self.layer(x[..., :3], x[..., 3:]) if self.two_inputs else self.layer(x)
        out = out[0] if isinstance(out, tuple) else out
        return self.head(torch.tanh(out).flatten(1))


def _old_weight_norm_linear():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the old weight_norm
        return torch.nn.utils.weight_norm(nn.Linear(6, 5))


REFUSED_LAYERS = {  # each crashed with a raw torch error at attach or at the first step (TypeError, RuntimeError)
    "bilinear": (lambda: _Head(nn.Bilinear(3, 3, 3), 3, two_inputs=True), "layer (Bilinear, a forward of 2 inputs)",
                 "method=nxbp or multiloss"),
    "lstm_proj": (lambda: _Head(nn.LSTM(6, 4, batch_first=True, proj_size=2), 8), "layer (LSTM, a fused recurrent "
                  "layer)", "model=rnn/lstm/gru/bilstm"),
    "gru_2_layers_bidirectional_dropout": (
        lambda: _Head(nn.GRU(6, 4, num_layers=2, bidirectional=True, dropout=0.3, batch_first=True), 32),
        "layer (GRU, a fused recurrent layer)", "method=nxbp or jl"),
    "lstm": (lambda: _Head(nn.LSTM(6, 4, batch_first=True), 16), "layer (LSTM, a fused recurrent layer)",
             "method=nxbp or jl"),
    "old_weight_norm": (lambda: _Head(_old_weight_norm_linear(), 5), "layer (Linear, torch.nn.utils.weight_norm)",
                        "torch.nn.utils.parametrizations.weight_norm"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(REFUSED_LAYERS))
def test_layers_opacus_cannot_sample_are_refused_at_attach_in_one_line(case, mode):
    """Before: nn.Bilinear (two inputs: Opacus keeps the first) raised TypeError at the step, torch's fused
    LSTM/GRU RuntimeError at the step, the old weight_norm a deepcopy RuntimeError at attach (functorch)."""
    pytest.importorskip("opacus")
    build, where, accepted = REFUSED_LAYERS[case]
    torch.manual_seed(0)
    model = build()
    method = METHODS.build("opacus", cfg={"grad_sample_mode": mode, "uncertified_ok": True}, clip=1.0, sigma=0.0)
    with pytest.raises(DprunError) as e:
        model = method.attach(model)
        x = torch.randn(2, 4, 6) if isinstance(model.layer, nn.RNNBase) else torch.randn(2, 6)
        method.step(model, loss_fn, x, torch.tensor([0, 1]), torch.optim.SGD(model.parameters(), lr=0.1),
                    sample_rate=0.5, expected_batch_size=2.0)
    message = str(e.value)
    assert message.startswith(f"method=opacus grad_sample_mode={mode} cannot train {where}: "), message
    assert accepted in message and "\n" not in message
    assert method.hooks is None  # refused before any hook was attached
