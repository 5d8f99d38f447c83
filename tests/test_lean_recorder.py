"""Book-keeping's lean recorder (runner/norms/lean.py, issue 31): the same clipped sums as Recorder, fewer bytes.

The exactness against nxBP is tests/test_exact_methods.py (reweight bk runs the lean recorder); the adversarial
contract is tests/test_certified_clipping.py. Here: lean vs Recorder on the same step, the fallback to Recorder when
the source-only backward misses a call, and what the lean recorder does not keep (outputs; records a stash covers).
"""
from __future__ import annotations

import copy
import gc
import weakref

import torch
from torch import nn

from runner.bench.common import loss_fn, step_memory_bytes, synthetic_batch
from runner.data.base import DataInfo
from runner.methods import METHODS
from runner.models import MODELS
from runner.norms import plan_model
from runner.norms import streaming
from runner.norms.lean import LeanRecorder
from runner.norms.outer import Stash

IMDB_SMALL = DataInfo("imdb", (40,), 2, "text", 500, 100, 100)
MNIST = DataInfo("mnist", (1, 28, 28), 10, "image", None, 60000, 10000)


def clipped_step(model, x, y, lean: bool, clip: float = 0.5):
    """(clipped sum per parameter, norms) of one reweight-bk privatize, the lean recorder on or off."""
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=clip, sigma=0.0)
    method.privacy_check = False
    model = method.attach(copy.deepcopy(model))
    method.plan(model)
    method._lean = lean
    out = method.privatize(model, loss_fn, x, y)
    return [p.grad.clone() for p in model.parameters()], out.norms, method


def models():
    torch.manual_seed(0)
    text = MODELS.build("transformer", IMDB_SMALL, dropout=0.0)
    xt, yt = synthetic_batch(IMDB_SMALL, 6, torch.device("cpu"))
    lstm = MODELS.build("lstm", MNIST)
    cnn = MODELS.build("bu_cnn", MNIST)
    xi, yi = synthetic_batch(MNIST, 5, torch.device("cpu"))
    return [(text, xt, yt), (lstm, xi, yi), (cnn, xi, yi)]


def assert_lean_equals_nxbp(model, x, y, clip: float):
    """reweight bk's step (lean recorder asked for) equals the nxBP oracle's norms and clipped sums (float64);
    returns the method (whether it kept the lean recorder)."""
    grads, norms, method = clipped_step(model, x, y, lean=True, clip=clip)
    oracle = METHODS.build("nxbp", clip=clip, sigma=0.0)
    oracle.privacy_check = False
    ref = oracle.attach(copy.deepcopy(model))
    out = oracle.privatize(ref, loss_fn, x, y)
    torch.testing.assert_close(norms, out.norms, rtol=1e-6, atol=0)
    for g, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12)
    return method


def test_lean_and_recorder_give_the_same_clipped_sums_and_norms():
    for model, x, y in models():
        lean, norms_lean, method = clipped_step(model, x, y, lean=True)
        assert method._lean  # the lean recorder served the step (no fallback)
        full, norms_full, _ = clipped_step(model, x, y, lean=False)
        # the same tensors, the layers' squared norms added in backward order instead of the plan's: rounding only
        torch.testing.assert_close(norms_lean, norms_full, rtol=1e-6, atol=0)
        for a, b in zip(lean, full):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class InputNeedsGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_a_call_the_source_backward_misses_falls_back_to_recorder_exactly(monkeypatch):
    """An input that requires grad leaves no source layer: the lean backward reaches no hooked call, so the step
    starts again with Recorder (and the method keeps Recorder for this model); the result is nxBP's."""
    monkeypatch.setattr(streaming, "CAPTURE_BYTES", 0)  # every call hooked, as a large layer's
    torch.manual_seed(1)
    model = InputNeedsGrad().double()
    x, y = torch.randn(4, 4, dtype=torch.float64, requires_grad=True), torch.tensor([0, 1, 2, 1])
    method = assert_lean_equals_nxbp(model, x, y, clip=0.3)
    assert not method._lean


def test_small_calls_are_captured_without_hooks_and_stay_exact():
    """Calls whose outputs are at most CAPTURE_BYTES get no tensor hook: the one backward returns their
    output-gradients (asked by gradient edge), so even the calls a source-only backward cannot reach (an input that
    requires grad) are served without the Recorder fallback, and the norms are nxBP's."""
    torch.manual_seed(1)
    model = InputNeedsGrad().double()
    x, y = torch.randn(4, 4, dtype=torch.float64, requires_grad=True), torch.tensor([0, 1, 2, 1])
    plan = plan_model(model)
    with LeanRecorder(plan, "auto", {}) as rec:
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    assert not rec.tensor_hooks and len(rec.captured) == 2  # both Linears' calls, by edge
    assert rec.backward(losses.sum(), len(y)) is not None and rec.complete
    method = assert_lean_equals_nxbp(model, x, y, clip=0.3)
    assert method._lean  # no fallback


def test_a_captured_call_after_an_inplace_change_gets_the_layers_own_output_gradient():
    """The edge is taken at the call: a ReLU(inplace=True) on the Linear's output afterwards does not move it (the
    gradient is that of the Linear's output, as a tensor hook registered at the call gets), so the norms are
    nxBP's whether the call is captured (for its size, or deferred with no output held: method.defer) or hooked."""
    for capture, defer in ((streaming.CAPTURE_BYTES, "off"), (0, "off"), (0, "all")):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)).double()
        x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
        plan = plan_model(model)
        with LeanRecorder(plan, "auto", {}, capture_bytes=capture, defer=defer) as rec:
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        assert bool(rec.captured) == (capture > 0 or defer == "all")
        assert all(c[4] is None for c in rec.captured)  # the forward is over: no output held either way
        norms_sq = rec.backward(losses.sum(), len(y))
        expected = torch.stack([torch.cat([p.flatten() for p in torch.autograd.grad(
            nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))]).square().sum()
            for i in range(len(y))])
        torch.testing.assert_close(norms_sq, expected, rtol=1e-6, atol=0)


class AddAfterLinear(nn.Module):
    """The Linear's output goes only into an add, which saves nothing for its backward: autograd frees it."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 2)
        self.seen: list = []

    def forward(self, x):  # (B, T, 16)
        h = self.proj(x)
        self.seen.append(weakref.ref(h))
        return self.head(torch.tanh(x + h).mean(1))


def test_the_lean_recorder_keeps_no_layer_output_and_drops_records_a_stash_covers():
    torch.manual_seed(2)
    model = AddAfterLinear()
    x, y = torch.randn(3, 16, 16), torch.tensor([0, 1, 1])
    plan = plan_model(model)
    stashes: dict = {}
    with LeanRecorder(plan, "auto", stashes) as rec:
        losses = loss_fn(model(x), y)
    gc.collect()
    assert model.seen[-1]() is None  # the output was freed after the forward: the recorder holds no reference
    rec.backward(losses.sum(), len(y))
    # proj at T = 16, 16 -> 16: its per-example gradient (256 numbers) is kept (direct: smaller than its records,
    # 16 * 32, and cheaper than ghost): the clipped sum adds the stash, so its records are gone already
    assert rec.kept[id(model.proj)] == [] and "weight" in stashes[id(model.proj)]
    assert len(rec.kept[id(model.head)]) == 1  # T = 1: its (input, output-gradient) wait for the clipped sum


def test_lean_book_keeping_peaks_lower_than_recorder_on_a_transformer():
    """The step's peak bytes (the bench's CPU measure): outputs not kept, stash-covered records freed in the
    backward. Measured at B=32 on the bench transformer: Recorder 1.87x the non-private step, lean 1.31x."""
    torch.manual_seed(0)
    model = MODELS.build("transformer", IMDB_SMALL, dropout=0.0)
    x, y = synthetic_batch(IMDB_SMALL, 16, torch.device("cpu"))
    peaks = {}
    for lean in (True, False):
        method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))

        def step():
            method.plan(m)
            method._lean = lean
            method.privatize(m, loss_fn, x, y)

        step()
        peaks[lean] = step_memory_bytes(step, torch.device("cpu"),
                                        before=lambda: [setattr(p, "grad", None) for p in m.parameters()])
    assert peaks[True] < 0.85 * peaks[False], peaks


def assert_same_sums(model, x, y, options: list[dict]) -> None:
    """reweight bk's clipped sums under each of `options` (keep rules: memory, not the step) equal the first's."""
    sums = []
    for option in options:
        method = METHODS.build("reweight", cfg={"mode": "bk", **option}, clip=0.5, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        method.privatize(m, loss_fn, x, y)
        sums.append([p.grad.clone() for p in m.parameters()])
    for other in sums[1:]:
        for a, b in zip(sums[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_keep_trades_memory_for_time_and_never_changes_the_step():
    """method.keep=0 keeps no per-example gradient, a large keep keeps every one it can: the same clipped sums
    (both exact), and the kept per-example gradients show in the stashes."""
    torch.manual_seed(3)
    model = MODELS.build("transformer", IMDB_SMALL, dropout=0.0)
    x, y = synthetic_batch(IMDB_SMALL, 4, torch.device("cpu"))
    assert_same_sums(model, x, y, [{"keep": keep} for keep in (0.0, 1.1, 100.0)])
    plan = plan_model(model)
    kept = {}
    for keep in (0.0, 100.0):
        stashes: dict = {}
        with LeanRecorder(plan, "direct", stashes, keep) as rec:
            losses = loss_fn(model(x), y)
        rec.backward(losses.sum(), len(y))
        kept[keep] = sum("weight" in stashes.get(id(m), {}) for m in model.modules() if isinstance(m, nn.Linear))
    assert kept[0.0] == 0 and kept[100.0] >= 6  # q, k, v, out, linear1, linear2 (and the head) keep G_i


def test_a_bad_keep_is_one_line_naming_what_is_accepted():
    import pytest

    from runner.errors import DprunError
    for bad in ("lots", -1, float("nan")):
        with pytest.raises(DprunError, match=r"method\.keep=.* a number >= 0"):
            METHODS.build("reweight", cfg={"keep": bad}, clip=1.0, sigma=1.0)


def test_keep_mb_keeps_the_layers_saving_most_time_per_byte_within_the_budget():
    """method.keep_mb: at B=4, T=40 the attention projections cost 0.37 MB each to keep and save 65 multiply-adds per
    extra byte, the feed-forward layers 1.83 MB and 52: a 1.5 MB budget keeps the four projections; 2 MB keeps the
    feed-forward layer the first backward reaches (the others are not seen yet), then, every shape known, the four
    projections; the step's admitted bytes never exceed the budget, and every budget gives the same clipped sums."""
    from runner.norms.keep_budget import KeepBudget

    torch.manual_seed(3)
    model = MODELS.build("transformer", IMDB_SMALL, dropout=0.0)
    x, y = synthetic_batch(IMDB_SMALL, 4, torch.device("cpu"))
    plan = plan_model(model)
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    def kept_layers(budget):
        budget.begin_step()
        stashes: dict = {}
        with LeanRecorder(plan, "direct", stashes, budget) as rec:
            losses = loss_fn(model(x), y)
        rec.backward(losses.sum(), len(y))
        assert budget.used <= budget.limit
        return {names[key] for key, stash in stashes.items() if key in names and "weight" in stash}

    attention = {"q", "k", "v", "out"}
    assert kept_layers(KeepBudget(0)) == set()
    assert kept_layers(KeepBudget(1.5)) == attention
    two = KeepBudget(2.0)
    assert kept_layers(two) == {"linear2"}  # the first backward: linear2 is offered first and fits
    assert kept_layers(two) == attention  # then the best per byte, from every layer's shape
    assert kept_layers(KeepBudget(100)) == attention | {"linear1", "linear2"}
    assert_same_sums(model, x, y, [{"keep_mb": mb} for mb in (0, 1.5, 100)])
    # with Recorder (method.recorder=auto's choice on CUDA): a budget there gives the same sums too
    assert_same_sums(model, x, y, [{}] + [{"keep_mb": mb, "recorder": "full"} for mb in (0, 1.5, 100)])


def test_a_bad_keep_mb_is_one_line():
    import pytest

    from runner.errors import DprunError
    for bad in ("lots", -1, True):
        with pytest.raises(DprunError, match=r"^method\.keep_mb=.* is not valid: null \(method\.keep decides per "
                                             r"layer\) or a number of megabytes >= 0"):
            METHODS.build("reweight", cfg={"keep_mb": bad}, clip=1.0, sigma=1.0)


def test_a_recurrent_cells_calls_are_kept_as_one_sequence():
    """h_proj is called once per time step: its T records become the one (B, T, h) / (B, T, 4h) pair the norm was
    formed from, so the clipped sum is one GEMM over B*T rows (the exactness: the first test, on the LSTM)."""
    torch.manual_seed(4)
    model = MODELS.build("lstm", MNIST)
    x, y = synthetic_batch(MNIST, 3, torch.device("cpu"))
    plan = plan_model(model)
    with LeanRecorder(plan, "auto", {}) as rec:
        losses = loss_fn(model(x), y)
    rec.backward(losses.sum(), len(y))
    cell = next(m for name, m in model.named_modules() if name.endswith("h_proj"))
    (a, g), = rec.kept[id(cell)]
    assert a.shape == (3, 28, cell.in_features) and g.shape == (3, 28, cell.out_features)


def test_an_in_place_relu_after_a_linear_is_exact_under_lean_book_keeping():
    """Recorder refused it (the recorded output changed); the tensor hook gets the gradient of the value the layer
    produced, so the lean step is exact: nxBP's clipped sum."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    method = assert_lean_equals_nxbp(model, x, y, clip=0.2)
    assert method._lean


def test_a_module_called_again_is_hooked_and_its_norm_formed_inside_the_backward(monkeypatch):
    """Capture is for modules called once: a recurrent cell's h_proj (28 calls) has its first call's capture turned
    back into a tensor hook at its second call, so its norm is formed inside the backward (waiting for the end, its
    transients met every other layer's records: the LSTM's bk step went from 23.6 to 32.6 MB at B=128), and the
    step's peak is no higher than with every call hooked."""
    torch.manual_seed(4)
    model = MODELS.build("lstm", MNIST)
    x, y = synthetic_batch(MNIST, 16, torch.device("cpu"))
    plan = plan_model(model)
    names = {id(m): n for n, m in model.named_modules()}
    with LeanRecorder(plan, "auto", {}) as rec:
        losses = loss_fn(model(x), y)
    assert {names[c[0]] for c in rec.captured} == {"recurrent.x_proj", "head.0"}
    assert all(c[4] is None for c in rec.captured)  # no output held once the forward is over
    rec.backward(losses.sum(), len(y))

    def peak(capture_bytes):
        monkeypatch.setattr(streaming, "CAPTURE_BYTES", capture_bytes)
        method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=0.0)
        net = method.attach(copy.deepcopy(model))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step = lambda: method.step(net, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=16.0)  # noqa: E731
        step()
        return step_memory_bytes(step, torch.device("cpu"), before=lambda: opt.zero_grad(set_to_none=True))

    assert peak(2**21) <= peak(0)


def test_installed_call_hooks_record_only_for_their_own_open_recorder():
    """runner/norms/hooks.py install_call_hooks: reweight gives each covered module ONE forward hook, kept (a second
    method on the same model adds none); with no recorder open it records nothing, and a recorder open on a deep copy
    (its own modules) receives none of the original's calls. The copy's step equals the original's."""
    from runner.norms.hooks import INSTALLED, Recorder, install_call_hooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    first = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=0.0)
    model = first.attach(model)
    first.plan(model)
    METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=0.0).attach(model)  # a second method, same model
    install_call_hooks(plan_model(model))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert all(getattr(m, INSTALLED) and len(m._forward_hooks) == 1 for m in linears)

    x = torch.randn(4, 6)
    copy_ = copy.deepcopy(model)
    with Recorder(plan_model(copy_)) as rec:
        model(x)  # the original's calls: not the copy's recorder's
        assert all(not calls for calls in rec.calls.values())
        copy_(x)
        assert all(len(calls) == 1 for calls in rec.calls.values())
    model(x)  # nothing open: nothing recorded, nothing raised
    torch.testing.assert_close(copy_(x), model(x))


def test_a_conv_norm_cut_into_chunks_is_exact_and_peaks_lower(monkeypatch):
    """bu_cnn's conv1 im2col is ~4x its records: book-keeping forms its norm (and its kept per-example gradients)
    over chunks of examples (lean.BK_TRANSIENT_BUDGET). With the 8 MiB floor lifted the chunks run at this small
    batch: exact against nxBP (float64, clip below the norms), chunked for conv1 and for keep=0 (no stash) too,
    and the step peaks lower than the same step in one piece. (On the CPU a kept conv G_i is formed by rows, without
    the im2col: runner/norms/conv.py by_rows, off here; the rows route peaks no higher than the chunks.)"""
    from runner.norms import conv, lean

    by_rows = conv.by_rows
    monkeypatch.setattr(conv, "by_rows", lambda layer, inp: False)
    torch.manual_seed(0)
    model = MODELS.build("bu_cnn", MNIST).double()
    x, y = synthetic_batch(MNIST, 6, torch.device("cpu"))
    x = x.double()
    chunked = []
    real = lean.LeanRecorder._add_chunked
    monkeypatch.setattr(lean.LeanRecorder, "_add_chunked",
                        lambda self, module, *a: (chunked.append(type(module).__name__), real(self, module, *a))[1])
    monkeypatch.setattr(lean, "BK_FLOOR_BYTES", 0)
    monkeypatch.setattr(lean, "CHUNKS", {})  # sized afresh under these settings
    method = assert_lean_equals_nxbp(model, x, y, clip=0.05)
    assert method._lean and chunked.count("Conv2d") >= 1
    assert_same_sums(model, x, y, [{"keep": 0.0}, {"keep": 1.1}])

    def peak(budget):
        monkeypatch.setattr(lean, "BK_TRANSIENT_BUDGET", budget)
        monkeypatch.setattr(lean, "CHUNKS", {})
        m = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=0.0)
        m.privacy_check = False
        net = m.attach(copy.deepcopy(model))
        return step_memory_bytes(lambda: m.privatize(net, loss_fn, x, y), torch.device("cpu"))

    budget = lean.BK_TRANSIENT_BUDGET
    chunks = peak(budget)
    assert chunks < peak(1e9)  # 1e9: one piece
    monkeypatch.setattr(conv, "by_rows", by_rows)
    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 0)  # the rows route at this batch
    assert peak(budget) <= chunks


def test_recorder_full_takes_recorder_from_the_start_and_is_exact(monkeypatch):
    """method.recorder=full (the order before the lean recorder: every output-gradient at the backward's end, the
    norms after it) never builds a LeanRecorder and gives nxBP's norms and clipped sums; lean (the default) does."""
    from runner.methods import reweight

    built = []

    class Counting(LeanRecorder):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(reweight, "LeanRecorder", Counting)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    oracle = METHODS.build("nxbp", clip=0.4, sigma=0.0)
    oracle.privacy_check = False
    ref = oracle.attach(copy.deepcopy(model))
    expected = oracle.privatize(ref, loss_fn, x, y)
    for recorder, builds in (("full", 0), ("lean", 1)):
        built.clear()
        method = METHODS.build("reweight", cfg={"mode": "bk", "recorder": recorder}, clip=0.4, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        out = method.privatize(m, loss_fn, x, y)
        assert len(built) == builds, recorder
        torch.testing.assert_close(out.norms, expected.norms, rtol=1e-6, atol=0)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)


def test_an_unknown_recorder_is_one_line_naming_the_choices():
    import pytest

    from runner.errors import DprunError

    with pytest.raises(DprunError, match=r"method.recorder 'fast'.*lean, full") as err:
        METHODS.build("reweight", cfg={"mode": "bk", "recorder": "fast"}, clip=1.0, sigma=0.0)
    assert "\n" not in str(err.value)


class SeqNet(nn.Module):
    """A Linear over 12 positions whose records book-keeping keeps (its per-example gradient, 24 x 24, is larger than
    1.1 x its records, 12 x 48), one whose per-example gradient it keeps instead (4 x 24 <= 1.1 x 12 x 28: stash
    only), and a head; `twice` calls the first Linear a second time (on its own output)."""

    def __init__(self):
        super().__init__()
        self.wide, self.narrow, self.head = nn.Linear(24, 24), nn.Linear(24, 4), nn.Linear(4, 3)
        self.twice = False

    def forward(self, x):  # (B, 12, 24)
        h = torch.tanh(self.wide(x))
        if self.twice:
            h = torch.tanh(self.wide(h))
        return self.head(torch.tanh(self.narrow(h)).mean(1))


def defer_step(method, model, x, y):
    """One privatize; returns (norms, clipped sums, (tensor hooks, deferred calls) of its recorder's backward)."""
    seen = []
    real = streaming.StreamingNorms._grad

    def counted(self, loss, targets, keep_graph):
        seen.append((len(self.tensor_hooks), sum(1 for c in self.captured if c[3] == 0 and c[4] is None)))
        return real(self, loss, targets, keep_graph)

    streaming.StreamingNorms._grad = counted
    try:
        for p in model.parameters():
            p.grad = None
        out = method.privatize(model, loss_fn, x, y)
    finally:
        streaming.StreamingNorms._grad = real
    return out.norms, [p.grad.clone() for p in model.parameters()], seen[-1]


def nxbp_step(model, x, y, clip):
    oracle = METHODS.build("nxbp", clip=clip, sigma=0.0)
    oracle.privacy_check = False
    ref = oracle.attach(copy.deepcopy(model))
    out = oracle.privatize(ref, loss_fn, x, y)
    return out.norms, [p.grad for p in ref.parameters()]


def test_defer_forms_the_norms_of_record_keeping_layers_after_the_backward_exactly(monkeypatch):
    """method.defer=on: the first step hooks every layer (nothing known yet); from the second on, the layers whose
    records the clipped sums keep anyway (wide; head, T = 1) have no hook, their output-gradients come back from the
    backward by gradient edge and their norms are formed after it, while the stash-only layer (narrow) keeps its hook
    (its records freed inside the backward). The norms and clipped sums are nxBP's at every step; defer=off never
    defers; defer=all defers every layer from the first step. (No small layer is captured for its size here:
    CAPTURE_BYTES 0.)"""
    monkeypatch.setattr(streaming, "CAPTURE_BYTES", 0)
    torch.manual_seed(4)
    model = SeqNet().double()
    x, y = torch.randn(5, 12, 24, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    want_norms, want = nxbp_step(model, x, y, clip=0.2)
    for defer, expected in (("on", [(3, 0), (1, 2), (1, 2)]), ("off", [(3, 0)] * 3), ("all", [(0, 3)] * 3)):
        # method.late=off: the stash-only layer would otherwise go late (no hook either: tests/test_late_layers.py)
        method = METHODS.build("reweight", cfg={"mode": "bk", "defer": defer, "late": "off"}, clip=0.2, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        counts = []  # (tensor hooks, deferred calls) of each step's backward
        for _ in range(3):
            norms, grads, count = defer_step(method, m, x, y)
            counts.append(count)
            torch.testing.assert_close(norms, want_norms, rtol=1e-6, atol=0)
            for g, w in zip(grads, want):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
        assert counts == expected, defer
        assert method._lean


def test_a_deferred_layer_called_again_is_still_exact(monkeypatch):
    """A layer deferred from its single call the step before, called twice this step: its first call stays
    captured (no output was held to hook), the second is hooked, and its norm waits for both: nxBP's."""
    monkeypatch.setattr(streaming, "CAPTURE_BYTES", 0)
    torch.manual_seed(5)
    model = SeqNet().double()
    x, y = torch.randn(4, 12, 24, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    method = METHODS.build("reweight", cfg={"mode": "bk", "defer": "on", "late": "off"}, clip=0.3, sigma=0.0)
    method.privacy_check = False
    m = method.attach(copy.deepcopy(model))
    for _ in range(2):
        defer_step(method, m, x, y)
    m.twice = model.twice = True
    want_norms, want = nxbp_step(model, x, y, clip=0.3)
    norms, grads, count = defer_step(method, m, x, y)
    assert count == (2, 2)  # hooked: narrow, wide's second call; deferred: wide's first call, head
    torch.testing.assert_close(norms, want_norms, rtol=1e-6, atol=0)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


class UnusedCall(nn.Module):
    """A trainable module called in the forward whose output never reaches the loss: not used at all, used only
    through argmax (no gradient), or one of two calls detached. Review 44: the lean recorder's backward handed the
    None gradient of such a call to its hook, which read its shape (AttributeError) instead of a zero gradient."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.fc, self.aux, self.head = how, nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):  # (B, 6)
        h = torch.tanh(self.fc(x))
        if self.how == "unused":
            _ = self.aux(x)
        elif self.how == "argmax":
            h = h + self.aux(x).argmax(-1, keepdim=True).to(h.dtype)
        else:  # "detached": aux called twice, the first call's output detached
            h = h + self.aux(x).detach() + self.aux(h)
        return self.head(h)


def test_a_call_whose_output_does_not_reach_the_loss_counts_as_a_zero_gradient():
    """Every recorder and deferral gives nxBP's norms and clipped sums (aux's sum 0 where no call reaches the loss)."""
    torch.manual_seed(6)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    for how in ("unused", "argmax", "detached"):
        model = UnusedCall(how).double()
        want_norms, want = nxbp_step(model, x, y, clip=0.05)
        for cfg in ({}, {"recorder": "full"}, {"defer": "all"}, {"keep_mb": 0}, {"late": "off", "norm": "ghost"}):
            method = METHODS.build("reweight", cfg={"mode": "bk", **cfg}, clip=0.05, sigma=0.0)
            method.privacy_check = False
            m = method.attach(copy.deepcopy(model))
            for _ in range(2):  # the second step: deferral and keep_mb act from what the first saw
                for p in m.parameters():
                    p.grad = None
                norms = method.privatize(m, loss_fn, x, y).norms
                grads = [p.grad for p in m.parameters()]
                torch.testing.assert_close(norms, want_norms, rtol=1e-6, atol=0)
                for g, w in zip(grads, want):
                    torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-9, atol=1e-12)


def test_defer_auto_is_on_on_cuda_only_and_holds_no_byte_more_on_a_transformer():
    """auto defers on CUDA only (a host-bound GPU step; on the CPU the gradient is still in cache), and an unknown
    value is one line naming the choices. On a transformer (ghost norms: small transients) deferring holds no byte
    more than forming each norm inside the backward (the records it waits with are kept for the clipped sums
    anyway): the IMDB transformer's bk step, CPU peak. (A conv's unfolded input can meet more at the backward's end:
    docs/methods.md.)"""
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=0.0)
    assert method.deferral(torch.device("cuda")) == "kept" and method.deferral(torch.device("cpu")) == "off"
    for defer, deferral in (("on", "kept"), ("off", "off"), ("all", "all")):
        built = METHODS.build("reweight", cfg={"mode": "bk", "defer": defer}, clip=1.0, sigma=0.0)
        assert built.deferral(torch.device("cpu")) == built.deferral(torch.device("cuda")) == deferral
    import pytest
    from runner.errors import DprunError

    with pytest.raises(DprunError, match=r"method.defer 'later'.*auto, on, off, all"):
        METHODS.build("reweight", cfg={"mode": "bk", "defer": "later"}, clip=1.0, sigma=0.0)
    torch.manual_seed(0)
    model = MODELS.build("transformer", IMDB_SMALL, dropout=0.0)
    x, y = synthetic_batch(IMDB_SMALL, 8, torch.device("cpu"))
    peaks = {}
    for defer in ("off", "on"):
        method = METHODS.build("reweight", cfg={"mode": "bk", "defer": defer}, clip=1.0, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        for _ in range(2):
            defer_step(method, m, x, y)
        _, _, (_, n_deferred) = defer_step(method, m, x, y)
        assert (n_deferred > 0) == (defer == "on")
        peaks[defer] = privatize_peak(method, m, x, y)
    assert peaks["on"] <= peaks["off"], peaks


def test_defer_all_drops_each_output_gradient_once_its_norm_is_formed():
    """defer=all forms every layer's norm after the backward; each output-gradient autograd returned is dropped as
    soon as its layer's norm has kept a stash (runner/norms/streaming.py _grad), not held until the last norm is
    formed: the bench transformer (B = 32, T = 150) peaks at 90.5 MB, against 114.1 before and 93.1 with
    defer=off."""
    model, x, y = bench_transformer()
    peaks = {}
    for defer in ("off", "all"):  # late=off: defer alone (late layers: tests/test_late_layers.py)
        method = METHODS.build("reweight", cfg={"mode": "bk", "defer": defer, "late": "off"}, clip=1.0, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        method.privatize(m, loss_fn, x, y)
        peaks[defer] = privatize_peak(method, m, x, y)
    assert peaks["all"] <= peaks["off"], peaks


def bench_transformer():
    """The bench's transformer_imdb workload (B = 32, T = 150, vocab 8185, dropout 0): model, x, y."""
    info = DataInfo("imdb", (150,), 2, "text", 8185, 100, 100)
    torch.manual_seed(0)
    model = MODELS.build("transformer", info, dropout=0.0)
    x, y = synthetic_batch(info, 32, torch.device("cpu"))
    return model, x, y


def privatize_peak(method, m, x, y) -> int:
    """Peak bytes of one privatize on the CPU above those live at its start (bench-clip's measure)."""
    return step_memory_bytes(lambda: method.privatize(m, loss_fn, x, y), torch.device("cpu"),
                             before=lambda: m.zero_grad(set_to_none=True))


def test_defer_with_a_keep_budget_is_exact_at_every_step(monkeypatch):
    """method.defer=on beside method.keep_mb (whose first step ranks the layers as its backward meets them, and whose
    later steps choose among all of them): norms and clipped sums are nxBP's at each of three steps."""
    monkeypatch.setattr(streaming, "CAPTURE_BYTES", 0)
    torch.manual_seed(6)
    model = SeqNet().double()
    x, y = torch.randn(5, 12, 24, dtype=torch.float64), torch.tensor([2, 1, 0, 1, 0])
    want_norms, want = nxbp_step(model, x, y, clip=0.25)
    for keep_mb in (0, 0.01, 1000):
        method = METHODS.build("reweight", cfg={"mode": "bk", "defer": "on", "keep_mb": keep_mb}, clip=0.25,
                               sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        for _ in range(3):
            norms, grads, _ = defer_step(method, m, x, y)
            torch.testing.assert_close(norms, want_norms, rtol=1e-6, atol=0)
            for g, w in zip(grads, want):
                torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_a_deferred_layer_whose_input_is_written_after_the_call_is_refused():
    """A forward that writes a recorded input after the call (tests/test_streaming_norms.py ModifiesItsInput): the
    version check runs when the norm is formed, so a norm deferred to the backward's end is refused as well, with
    the same one line, not formed from the changed input."""
    import pytest
    from runner.errors import DprunError
    from tests.test_streaming_norms import ModifiesItsInput

    model = ModifiesItsInput()
    x, y = torch.randn(2, 3, requires_grad=True), torch.tensor([0, 1])
    with LeanRecorder(plan_model(model), "auto", {}, capture_bytes=0, defer="all") as rec:
        losses = loss_fn(model(x), y)
    assert len(rec.captured) == 1 and not rec.tensor_hooks  # fc deferred, no hook
    with pytest.raises(DprunError, match=r"fc \(Linear\).*input was modified in place"):
        rec.backward(losses.sum(), len(y))


def test_the_records_clipped_sum_scales_the_smaller_side_exactly():
    """outer.clipped_sum from records (no stash): nu multiplies a (N, T, k) or g (N, T, o), whichever is smaller, so
    its copy is the smaller one; the sum equals float64 sum_i nu_i g_i^T a_i both ways, and a record whose nu is 0
    (a non-finite norm) adds nothing even when its rows are inf."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runner.norms.outer import clipped_sum

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mul.Tensor:
                self.numels.append(out.numel())
            return out

    torch.manual_seed(0)
    N, T = 5, 7
    for k, o in ((3, 11), (11, 3)):
        a, g = torch.randn(N, T, k), torch.randn(N, T, o)
        nu = torch.rand(N)
        nu[2] = 0.0
        a[2, 0, 0], g[2, 1, 0] = float("inf"), float("nan")
        with Sizes() as sizes:
            got = clipped_sum(a, g, nu)
        want = torch.einsum("i,ito,itk->ok", nu.double()[[0, 1, 3, 4]], g.double()[[0, 1, 3, 4]],
                            a.double()[[0, 1, 3, 4]])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert sizes.numels == [N * T * min(k, o)], (k, o, sizes.numels)


def test_keep_0_holds_the_non_private_steps_peak_on_the_bench_transformer():
    """With method.keep=0 the records are tensors the backward produces anyway (a layer's input, its
    output-gradient) and the clipped sums scale their smaller side: the bk step peaks at the non-private step's
    bytes on the bench transformer (B = 32, T = 150: 74.35 against 74.06 MB, below Opacus ghost's 77.80;
    docs/methods.md). Scaling the feed-forward's larger side put a (B, T, ff) copy on top (84.7 MB)."""
    model, x, y = bench_transformer()
    peaks = {}
    for name, cfg in (("nonprivate", {}), ("reweight", {"mode": "bk", "keep": 0})):
        method = METHODS.build(name, cfg=cfg, clip=1.0, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        gen = torch.Generator().manual_seed(0)
        step = lambda: method.step(m, loss_fn, x, y, opt, sample_rate=0.1, expected_batch_size=32,  # noqa: E731
                                   generator=gen)
        step()
        peaks[name] = step_memory_bytes(step, torch.device("cpu"), before=lambda: opt.zero_grad(set_to_none=True))
    assert peaks["reweight"] < 1.02 * peaks["nonprivate"], peaks  # 1.004x measured; the larger side: 1.14x


class ConvStack(nn.Module):
    """Three convs whose per-example gradients book-keeping keeps (T = 64 positions, k <= 72), then a Linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c3, self.fc = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.Linear(8, 4)

    def forward(self, x):  # x (B, 3, 8, 8)
        h = torch.tanh(self.c3(torch.tanh(self.c2(torch.tanh(self.c1(x))))))
        return self.fc(h.mean((2, 3)))


def test_a_conv_that_keeps_its_per_example_gradient_frees_its_records_inside_the_backward(monkeypatch):
    """A conv whose G_i (and bias sums) book-keeping kept is stash-only: the lean recorder drops its input and
    output-gradient at its norm, not at the clipped sums (ResNet-18 B = 16 on the CPU: 166.0 -> 110.0 MB,
    docs/bench.md "Stop 50"); the step stays nxBP's, and peaks lower than with the records held. Not when the
    recorder defers record-keeping layers' norms (method.defer=on, auto on a GPU): the convs keep their records and
    are deferred, as before."""
    from runner.norms import conv

    torch.manual_seed(0)
    model = ConvStack().double()
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1])
    kept = {}
    real_add = LeanRecorder._add

    def add(self, key):
        real_add(self, key)
        kept[self.rules[key][0]] = len(self.kept[key])  # path -> records still held

    monkeypatch.setattr(LeanRecorder, "_add", add)
    assert_lean_equals_nxbp(model, x, y, clip=0.05)
    assert kept == {"c1": 0, "c2": 0, "c3": 0, "fc": 1}, kept
    kept.clear()
    method = METHODS.build("reweight", cfg={"mode": "bk", "defer": "on"}, clip=0.05, sigma=0.0)
    method.privacy_check = False
    net = method.attach(copy.deepcopy(model))
    method.privatize(net, loss_fn, x, y)
    assert kept == {"c1": 1, "c2": 1, "c3": 1, "fc": 1}, kept  # records kept: deferred from the next step

    def peak():
        m = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=0.0)
        m.privacy_check = False
        net = m.attach(copy.deepcopy(model))
        privatize_peak(m, net, x, y)  # the first step learns the shapes
        return privatize_peak(m, net, x, y)

    stash_only = peak()
    monkeypatch.setattr(conv.ConvRule, "stash_only", lambda self, layer, stash: False)
    assert stash_only < peak()
    monkeypatch.undo()
    rule, layer = conv.ConvRule(), model.c1
    assert rule.stash_only(layer, {"weight": torch.zeros(6, 8, 27, dtype=torch.float64), "bias": torch.zeros(6, 8)})
    deferring = Stash(defers=True)
    deferring.update(weight=torch.zeros(6, 8, 27), bias=torch.zeros(6, 8))
    assert not rule.stash_only(layer, deferring)
    assert not rule.stash_only(layer, {"weight": torch.zeros(6, 8, 27)})  # the bias trains: its sums are needed
    assert rule.stash_only(model.c3, {"weight": torch.zeros(6, 8, 72)})  # no bias
