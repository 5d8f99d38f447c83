"""A record whose loss and JL estimate are finite but whose reverse-mode gradient is not (runner/methods/dropped.py)
adds nothing to the release, which stays finite: method=jl clips by forward-mode tangents or double-vjp projections,
and `torch.where(h >= 100, 0, sqrt(100 - h))` takes the selected branch's tangent while its backward forms 0 * inf =
nan in the other; an entropy bonus `where(p > 0, p log p, 0)` does the same where a softmax underflows to 0. Before,
one such record made the whole release nan (its presence revealed with certainty, the run ended as diverged). Its
own backward is found by bisection over the chunk's records, it is counted as non-finite, every other record adds
exactly what it adds without it. The chunk is formed again on the kept records' rows alone (no row stands in for a
record left out), so a model whose backward is not finite at a zero row (log 0, h / ||h||) is not refused, and its
zero records are left out too; reweight's recompute (a second forward through the same rows) is checked likewise.
Also: jl refuses EmbeddingBag at attach and turns torch.utils.checkpoint's and a missing derivative's errors into
one-line DprunErrors."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from runner.errors import DprunError
from runner.methods import METHODS, dropped


class WhereNet(nn.Module):
    """sqrt's branch is nan where h > 100 (a record of 1e4s), unselected: its tangent is not taken, its backward is
    0 * inf = nan."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 3)
        with torch.no_grad():
            self.a.weight.fill_(0.1)
            self.a.bias.zero_()

    def forward(self, x):
        h = self.a(x)  # (B, 1)
        return self.b(x) + torch.where(h >= 100, torch.zeros_like(h), torch.sqrt(100 - h))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class ZeroNan(nn.Module):
    """Not finite in the backward at an all-zero row (log 0 in an unselected branch): no record can be left out."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        s = x.abs().sum(1, keepdim=True)  # (B, 1)
        return self.b(x) + torch.where(s > 0, self.a(x) * s.log(), torch.zeros(()))


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def entropy_bonus(out, y):
    p = out.softmax(1)
    return ce(out, y) - 0.01 * -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(1)


def data(n=8, bad=(5,)):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    x[list(bad)] = 1e4  # WhereNet: h = 4e3 > 100; Mlp + entropy_bonus: the softmax underflows to exactly 0
    return x, y


IDIOMS = {"where_sqrt": (WhereNet, ce), "entropy": (Mlp, entropy_bonus)}
JL = [{"r": r, "jvp": jvp} for jvp in ("forward", "double_vjp") for r in (1, 4)]
CASES = [("jl", cfg) for cfg in JL] + [("reweight", {"mode": "twopass"}), ("reweight", {"mode": "recompute"})]


def case_id(case):
    name, cfg = case
    return "-".join([name, *map(str, cfg.values())])


def release(name, cfg, model, loss_fn, x, y, physical=None, compiled=False):
    """One step (sigma 0, lr 0): the clipped sum it releases (float64, flat) and its StepOutput."""
    from runner.methods.compiled import CompiledStep

    method = METHODS.build(name, cfg=cfg, clip=0.5, sigma=0.0)
    method.configure(physical_batch_size=physical)
    method.privacy_check = False  # the record, in the first-step check's probe rows, is another matter (not clipping)
    m = method.attach(copy.deepcopy(model))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    step = CompiledStep(method, "default", x.device, physical=8, backend="aot_eager") if compiled else method.step
    for _ in range(2 if compiled else 1):  # a compiled step's first call runs eager
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # jl: the same directions with and without the record
        out = step(m, loss_fn, x, y, opt, sample_rate=1.0, expected_batch_size=1.0)
    if compiled:
        assert step.compiled is not None, "the compiled step fell back to eager"
    return torch.cat([p.grad.double().flatten() for p in m.parameters()]), out


def adds_nothing(name, cfg, model, loss_fn, x, y, bad, **kw):
    """The release with the records `bad` equals the release without them, is finite and not zero; they are the
    step's non-finite records (norm or loss not finite: nonfinite_records counts them)."""
    keep = [i for i in range(len(y)) if i not in bad]
    with_bad, out = release(name, cfg, model, loss_fn, x, y, **kw)
    without, _ = release(name, cfg, model, loss_fn, x[keep], y[keep], **kw)
    assert torch.isfinite(with_bad).all(), "one record turned the release into nan"
    assert float(without.abs().max()) > 1e-3  # a release to compare, not zeros
    torch.testing.assert_close(with_bad, without, rtol=1e-5, atol=1e-7)
    finite = torch.isfinite(out.norms) & torch.isfinite(out.losses)
    assert (~finite).nonzero()[:, 0].tolist() == sorted(bad)


@pytest.mark.parametrize("physical", [None, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_a_record_whose_backward_is_nan_adds_nothing(idiom, case, physical):
    factory, loss_fn = IDIOMS[idiom]
    torch.manual_seed(0)
    x, y = data()
    adds_nothing(*case, factory(), loss_fn, x, y, bad=[5], physical=physical)


def test_bisection_finds_two_records_among_16(monkeypatch):
    """Two crafted records among 16: both found, at most 2 log2(16) passes each, not one per record."""
    passes = []
    formed_with = dropped.formed_with
    monkeypatch.setattr(dropped, "formed_with", lambda *a: passes.append(1) or formed_with(*a))
    torch.manual_seed(0)
    x, y = data(16, bad=(3, 12))
    adds_nothing("jl", {"r": 4}, WhereNet(), ce, x, y, bad=[3, 12])
    # the records kept, none (a zeroed row), both halves at each of log2(16) = 4 levels for each record, the final
    # sum: 3 + 2 * 4 * 2 at most (17 here: the top level's two halves are shared), against 16 passes for one each
    assert len(passes) <= 3 + 2 * 4 * 2


def test_every_record_finite_costs_no_second_pass(monkeypatch):
    passes = []
    monkeypatch.setattr(dropped, "formed_with", lambda *a: passes.append(1))
    x, y = data(bad=())
    release("jl", {"r": 2}, WhereNet(), ce, x, y)
    assert passes == []


@pytest.mark.parametrize("case", [("jl", {"r": 1, "jvp": "forward"}), ("jl", {"r": 2, "jvp": "forward"})],
                         ids=case_id)
def test_a_record_whose_backward_is_nan_adds_nothing_compiled(case):
    """compile= (Dynamo + AOTAutograd, eager kernels): the padded chunk is compiled, the check and the passes
    without the record run eager after it (Method.clipped_sum -> without_dropped). (jvp=double_vjp does not compile:
    AOTAutograd has no double backward; that step runs eager, logged.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = data()
    adds_nothing(*case, WhereNet(), ce, x, y, bad=[5], compiled=True)


@pytest.mark.parametrize("physical", [None, 3], ids=["one_chunk", "chunks_of_3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_model_not_finite_at_a_zero_row_leaves_its_zero_records_out(case, physical):
    """ZeroNan's backward is nan at a row of zeros (0 * log 0). When a record left out was replaced by a row of zeros,
    jl and twopass refused the step and recompute released nan; no row stands in for it now: the zero records add
    nothing, every other record what it adds without them."""
    torch.manual_seed(0)
    x, y = data(bad=())
    x[[2, 6]] = 0.0  # their own backward is nan, their losses and estimates finite
    adds_nothing(*case, ZeroNan(), ce, x, y, bad=[2, 6], physical=physical)


class DuplicatesPooled(nn.Module):
    """out_i = h_i + the h_j of every other row identical to row i: rows without an exact duplicate are independent.
    A copy of a kept record's row in a left-out record's place (stop 57's first filler) made one: 2 C (review 9)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))  # (B, 3)
        same = (x[:, None, :] == x[None, :, :]).all(-1) & ~torch.eye(len(x), dtype=torch.bool)  # (B, B)
        return h + torch.where(same[:, :, None], h[None, :, :], torch.zeros(())).sum(1)


class DuplicatesNan(DuplicatesPooled):
    """-inf wherever a row has a duplicate: a filler duplicating a kept record dropped the whole chunk (review 9)."""

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        with torch.no_grad():
            count = (x[:, None, :] == x[None, :, :]).all(-1).sum(1, keepdim=True).to(h.dtype)  # (B, 1), self included
        return h + (2 - count).log()


class ZeroGradFill(torch.autograd.Function):
    """Identity; its backward gives 10 x for a row whose output-gradient is exactly zero (a custom backward need not
    be linear): a masked filler row leaked the copied record's activations, 62 C (review 9)."""

    generate_vmap_rule = True  # jl's forward mode with r > 1 vmaps over its directions

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.where((g == 0).all(1, keepdim=True), 10 * x, g)

    @staticmethod
    def jvp(ctx, t):
        return t


class ZeroGradNet(Mlp):
    def forward(self, x):
        return self.b(ZeroGradFill.apply(torch.tanh(self.a(x))))


@pytest.mark.parametrize("physical", [None, 4], ids=["one_chunk", "chunks_of_4"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("build", [DuplicatesPooled, DuplicatesNan, ZeroGradNet], ids=lambda b: b.__name__)
def test_no_row_stands_in_for_a_record_left_out(build, case, physical):
    """The chunk is formed again on the kept records' rows alone: nothing a model does with a stand-in row (a
    duplicate of a kept record, a zero output-gradient) reaches the release, which equals the release without the
    nan records."""
    torch.manual_seed(0)
    x, y = data(bad=())
    x[[5, 7]] = float("nan")
    adds_nothing(*case, build(), ce, x, y, bad=[5, 7], physical=physical)


def test_a_chunk_with_no_record_kept_adds_exactly_zero():
    """Every record left out: the sum is zero without a pass (ZeroNan at all-zero rows: every row is nan alone)."""
    torch.manual_seed(0)
    x, y = data(bad=())
    x.zero_()
    for case in [("jl", {"r": 2, "jvp": "forward"}), ("reweight", {"mode": "twopass"}),
                 ("reweight", {"mode": "recompute"})]:
        released, out = release(*case, ZeroNan(), ce, x, y)
        assert torch.equal(released, torch.zeros_like(released)), case
        assert not bool(torch.isfinite(out.norms).any()), case


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(6, 4, mode="mean"), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bag(x)))


class BagWeights(Bag):
    """A frozen bag (accepted at attach) whose per-sample weights are trained: the derivative torch lacks is met in
    the step."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 4, mode="sum")
        self.bag.weight.requires_grad_(False)
        self.w = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(self.bag(x, per_sample_weights=torch.sigmoid(self.w(x.unsqueeze(-1).float())).squeeze(-1)))


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False))


@pytest.mark.parametrize("jvp", ["auto", "forward", "double_vjp"])
def test_jl_refuses_embedding_bag_at_attach(jvp):
    with pytest.raises(DprunError, match=r"^1\.bag \(EmbeddingBag\) cannot be trained with method=jl: .*multiloss"):
        METHODS.build("jl", cfg={"jvp": jvp}, clip=1.0, sigma=0.0).attach(nn.Sequential(nn.Identity(), Bag()))
    frozen = Bag()
    frozen.bag.weight.requires_grad_(False)
    METHODS.build("jl", cfg={"jvp": jvp}, clip=1.0, sigma=0.0).attach(frozen)  # nothing to differentiate there


@pytest.mark.parametrize("jvp", ["auto", "forward", "double_vjp"])
@pytest.mark.parametrize("check", [True, False], ids=["first_step_check", "no_check"])
def test_jl_step_errors_are_one_line(jvp, check):
    """torch.utils.checkpoint(use_reentrant=False) under forward-mode projections (a call in forward(), not a module:
    not visible at attach), and an operator without a derivative jl needs: one-line DprunErrors at the step."""
    g = torch.Generator().manual_seed(0)
    cases = [(Checkpointed(), torch.randn(4, 4, generator=g)), (BagWeights(), torch.randint(0, 6, (4, 7), generator=g))]
    for model, x in cases:
        method = METHODS.build("jl", cfg={"jvp": jvp, "r": 2}, clip=1.0, sigma=0.0)
        method.privacy_check = check
        m = method.attach(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        step = lambda: method.step(m, ce, x, torch.tensor([0, 1, 2, 0]), opt, sample_rate=1.0,  # noqa: E731
                                   expected_batch_size=1.0)
        if isinstance(model, Checkpointed) and jvp == "double_vjp":
            step()  # the double backward recomputes the checkpoint like any backward
            continue
        with pytest.raises(DprunError, match=r"^method=jl .*(checkpoint|cannot differentiate this model)") as e:
            step()
        assert "\n" not in str(e.value)


def test_reweight_refusing_embedding_bag_names_methods_that_take_it():
    """reweight has no norm rule for EmbeddingBag; its message named jl, which refuses it too (above)."""
    with pytest.raises(DprunError, match=r"^bag \(EmbeddingBag\) has trainable parameters .*multiloss or "
                                         r"method=nxbp") as e:
        METHODS.build("reweight", cfg={}, clip=1.0, sigma=0.0).attach(Bag())
    assert "method=jl or" not in str(e.value)
