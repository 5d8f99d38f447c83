"""compile= (runner/methods/compiled.py): the compiled step equals the eager step to float tolerance on CPU, and
every fallback is taken with one logged line, never silently.

Default suite: Dynamo traces the whole step (backend="eager": graph capture and graph breaks, eager kernels), for
nonprivate, reweight and jl; the padded sizes (buckets) get one graph each, never more, none sent to eager by
Dynamo's recompile limit; CUDA graphs' output reuse, emulated on the CPU, leaves a chunked step's sum unchanged.
-m slow: TorchInductor (compile=default) itself, minutes of compilation on a small CPU.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.base import Privatized
from runner.methods.compiled import CompiledStep, buckets, build_step, check_mode
from runner.methods.padding import bucket

CPU = torch.device("cpu")
CASES = [("nonprivate", {}), ("reweight", {"mode": "bk"}), ("reweight-twopass", {"mode": "twopass"}),
         ("reweight-recompute", {"mode": "recompute"}),
         ("jl", {"jvp": "forward"})]


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def setup(method_name, cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    method = METHODS.build(method_name.split("-")[0], cfg={**cfg, "r": 2}, clip=0.5, sigma=1.0)  # "reweight-twopass"
    model = method.attach(model)
    return model, method, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)


def train(method_name, cfg, make_step, steps=3):
    """Three steps on Poisson-like batches of 4, 5, 6 rows (one physical size, 8); the final parameters."""
    model, method, opt = setup(method_name, cfg)
    step = make_step(method)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    torch.manual_seed(5)
    noise = torch.Generator().manual_seed(3)
    outs = [step(model, loss_fn, x[:4 + i], y[:4 + i], opt, sample_rate=0.01, expected_batch_size=5.0,
                 generator=noise) for i in range(steps)]
    return [p.detach().clone() for p in model.parameters()], outs, step


def assert_close_params(a, b):
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def check_equal(method_name, cfg, physical=8, **compile_kwargs):
    ref, ref_outs, _ = train(method_name, cfg, lambda m: m.step)
    got, outs, step = train(method_name, cfg, lambda m: CompiledStep(m, "default", CPU, physical, **compile_kwargs))
    assert step.compiled is not None, "the step fell back to eager"
    assert_close_params(got, ref)
    for o, r in zip(outs, ref_outs):
        assert o.losses.shape == r.losses.shape
        torch.testing.assert_close(o.losses, r.losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method_name,cfg", CASES, ids=[c[0] for c in CASES])
def test_traced_step_equals_eager_step(method_name, cfg):
    torch._dynamo.reset()
    check_equal(method_name, cfg, backend="eager")


def test_the_certificates_bookkeeping_adds_no_graph_break():
    """The clipped sums' per-step question (runner/norms/certify.py clipped_sums_of, a ContextVar) is skipped inside a
    compiled graph: traced, it broke the step's graph once per layer (dynamo cannot trace ContextVar.get). Since the
    backward is traced into the graph (compiled.in_one_graph), a compiled bk step has no graph break at all."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    check_equal("reweight", {"mode": "bk"}, backend="eager")
    assert not dynamo_utils.counters["graph_break"], list(dynamo_utils.counters["graph_break"])


def test_a_compiled_bk_transformer_chunk_is_one_graph():
    """Issue 31's GPU route: a compiled book-keeping chunk of the transformer (attention, LayerNorm, embedding,
    feed-forward) is ONE graph per physical size, steady over steps, with the eager step's numbers. Before, the
    forward hooks registered inside the traced step and the backward's torch.autograd.grad were graph breaks Dynamo
    could not resume from: it ran the book-keeping frame eagerly (the lean recorder, tensor hooks and all), each layer
    a graph of its own: 20 graphs, and on the CPU bench the compiled bk step was 1.35x the eager one."""
    from runner.data.base import DataInfo
    from runner.models import MODELS

    info = DataInfo("tokens16", (16,), 2, "text", 64, 100, 100)
    x, y = torch.randint(1, 64, (6, 16), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1] * 3)
    graphs: list[int] = []

    def counting(gm, inputs):  # a Dynamo backend that runs the captured graph eagerly and counts it
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    def trained(make_step):
        torch.manual_seed(0)
        model = MODELS.build("transformer", info, layers=2, d_model=16, heads=2, ff=32, dropout=0.0)
        method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=1.0)
        model = method.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        step, noise = make_step(method), torch.Generator().manual_seed(3)
        for i in range(3):
            step(model, loss_fn, x[:4 + i % 2], y[:4 + i % 2], opt, sample_rate=0.01, expected_batch_size=5.0,
                 generator=noise)
        return [p.detach().clone() for p in model.parameters()], step

    torch._dynamo.reset()
    ref, _ = trained(lambda m: m.step)
    got, step = trained(lambda m: CompiledStep(m, "default", CPU, physical=8, backend=counting))
    assert step.compiled is not None and len(graphs) == 1, graphs  # the first step eager, then one graph, reused
    assert_close_params(got, ref)


class NormLayers(nn.Module):
    """Conv + GroupNorm, then LayerNorm + Linear over positions: the rules whose book-keeping stop 30 rewrote."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.ln, self.head = nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, x):  # (B, 1, 4, 4)
        h = self.gn(self.conv(x)).flatten(2).transpose(1, 2)  # (B, 16, 4)
        return self.head(self.ln(h)).mean(1)  # (B, 3)


def test_the_norm_rules_add_no_graph_break():
    """Dynamo does not break a bk step's graph, in a rule's norms or clipped sums least of all: a sum written through
    out= into half of a buffer, or torch.result_type, broke it there (stop 30's first both_sums), and every break
    costs a compiled GPU step its CUDA graph. Traced as CompiledStep traces it (the backward in the graph:
    compiled.in_one_graph), the norm layers' step is one graph."""
    torch.manual_seed(0)
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=1.0)
    model = method.attach(NormLayers())
    x, y = torch.randn(6, 1, 4, 4), torch.randint(0, 3, (6,))
    method.privatize(model, loss_fn, x, y)  # eager first, as a run's first step
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        explained = torch._dynamo.explain(method.privatize)(model, loss_fn, x, y)
    places = [f"{frame.filename.split('/runner/')[-1]}:{frame.lineno}" for reason in explained.break_reasons
              for frame in reason.user_stack[-1:]]
    assert explained.graph_count == 1 and not places, places


def test_traced_step_with_buckets_equals_eager_step():
    """Batches of 5 and 6 rows padded to 8, the one of 4 to 4 (no padding): two graphs, the eager step's numbers."""
    torch._dynamo.reset()
    check_equal("reweight", {"mode": "bk"}, physical=(4, 8), backend="eager")


@pytest.mark.slow
@pytest.mark.parametrize("method_name,cfg", CASES, ids=[c[0] for c in CASES])
def test_inductor_compiled_step_equals_eager_step(method_name, cfg):
    torch._dynamo.reset()
    check_equal(method_name, cfg)


def one_line(caplog, text):
    lines = [r.getMessage() for r in caplog.records if text in r.getMessage()]
    assert len(lines) == 1, lines


@pytest.mark.parametrize("mode", ["reduce-overhead", "cudagraphs"])
def test_cuda_only_modes_fall_back_to_default_on_cpu(mode, caplog):
    _, method, _ = setup("nonprivate", {})
    with caplog.at_level(logging.WARNING, logger="dprun"):
        step = CompiledStep(method, mode, CPU, physical=8)
    assert step.mode == "default" and step.compiled is not None
    one_line(caplog, f"compile={mode} needs CUDA")


def test_method_not_compiled_runs_eager_with_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="dprun"):
        ref, _, _ = train("nxbp", {}, lambda m: m.step)
        got, _, step = train("nxbp", {}, lambda m: CompiledStep(m, "default", CPU, physical=8))
    assert step.mode == "off" and step.compiled is None
    one_line(caplog, "method=nxbp is not compiled")
    assert_close_params(got, ref)


def test_a_failing_compilation_falls_back_to_eager_once(caplog):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("backend exploded\nsecond line")

    def make(m):
        s = CompiledStep(m, "default", CPU, physical=8)
        s.compiled = broken
        return s

    ref, _, _ = train("reweight", {"mode": "bk"}, lambda m: m.step)
    with caplog.at_level(logging.WARNING, logger="dprun"):
        got, outs, step = train("reweight", {"mode": "bk"}, make)
    assert calls == [1] and step.compiled is None and step.mode == "off"
    one_line(caplog, "compile=default failed for method=reweight (RuntimeError: backend exploded)")
    assert_close_params(got, ref)
    assert [len(o.losses) for o in outs] == [4, 5, 6]


def test_modes():
    assert check_mode(False) == "off" and check_mode("default") == "default"
    with pytest.raises(DprunError, match="unknown compile"):
        check_mode("max-autotune-ish")
    _, method, _ = setup("nonprivate", {})
    assert build_step(method, "off", CPU) == method.step


def test_the_cli_step_pads_each_ranks_share_to_buckets():
    """runner/train.py: buckets around each rank's expected share of the Poisson batch; physical_batch_size: one size."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from runner.train import build_run_step

    _, method, _ = setup("nonprivate", {})
    private = SimpleNamespace(method=method, sampler=SimpleNamespace(sample_rate=0.01, n=25_600))  # B = 256
    made = lambda world, **cfg: build_run_step(OmegaConf.create({"compile": "default", **cfg}), private, CPU,  # noqa: E731
                                               SimpleNamespace(size=world))
    assert made(1).physical == buckets(256) == (240, 256, 272, 288, 320)
    assert made(2).physical == buckets(128)
    assert made(2, physical_batch_size=64).physical == (64,)
    assert build_run_step(OmegaConf.create({"compile": False}), private, CPU, SimpleNamespace(size=1)) == method.step


def poisson_overhead(B, sizes):
    """E[padded rows] / E[rows] - 1 for a Poisson(B) batch size."""
    pmf = lambda n: math.exp(n * math.log(B) - B - math.lgamma(n + 1))  # noqa: E731
    ns = range(int(B + 12 * math.sqrt(B) + 20))
    return sum(pmf(n) * bucket(n, sizes) for n in ns) / B - 1


@pytest.mark.parametrize("B", [1, 3, 8, 32, 100, 256, 4096])
def test_buckets_bound_the_padding(B):
    sizes = buckets(B)
    s = math.sqrt(B)
    assert 1 <= len(sizes) <= 5 and list(sizes) == sorted(set(sizes)) and all(b % 8 == 0 for b in sizes)
    assert sizes[-1] >= B + 4 * s  # the top: where a Poisson batch rarely goes (the one size before buckets)
    before = 0
    for n in range(sizes[-1] + 1):
        P = bucket(n, sizes)
        assert n <= P in sizes and P >= before  # holds the batch; monotone in n
        before = P
        assert P - n < 2 * s + 8 if n > B - s else P <= B - s + 8  # compiled.buckets' worst cases
    assert bucket(sizes[-1] + 3, sizes) == sizes[-1] + 3  # above the top: its own size, not truncated
    assert bucket(5, 8) == 8  # one size (physical_batch_size)


def test_buckets_pad_far_less_than_one_size():
    """The docstring's averages: 13% more rows at B = 32 and 3% at 256, where one size B + 4 sqrt(B) padded 75%
    and 25% (issue 31)."""
    assert buckets(32) == (32, 40, 48, 56) and buckets(256) == (240, 256, 272, 288, 320)
    assert poisson_overhead(32, buckets(32)) < 0.14 and poisson_overhead(32, (56,)) > 0.74
    assert poisson_overhead(256, buckets(256)) < 0.035 and poisson_overhead(256, (320,)) > 0.24


def test_each_size_compiles_once(caplog):
    """Four sizes, one graph each, with Dynamo's recompile limit set below four: CompiledStep raises it (past it torch
    would run the later sizes eager). Another batch size in a size already seen compiles nothing (the padding runs
    eager, outside the compiled function: a graph per batch size before). The sizes are logged once."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model, method, opt = setup("nonprivate", {})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)

    def frames_after(n):
        step(model, loss_fn, x[:n], y[:n], opt, sample_rate=0.01, expected_batch_size=20.0)
        return counter.frame_count

    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.INFO, logger="dprun"):
        step = CompiledStep(method, "default", CPU, physical=(8, 16, 24, 32), backend=counter)
        frames_after(32)  # the first step: eager
        frames = [frames_after(n) for n in (5, 12, 20, 30)]  # sizes 8, 16, 24, 32
        assert frames[0] > 0 and frames == [frames[0] * k for k in (1, 2, 3, 4)]
        assert [frames_after(n) for n in (7, 13, 24, 31, 1)] == [frames[-1]] * 5  # sizes seen: no new graph
    one_line(caplog, "padded to the smallest of 4 sizes (8, 16, 24, 32 rows), one graph each")


def test_no_norm_hook_runs_eager_past_the_recompile_limit(caplog):
    """reweight's norm hooks compile once per module and size: with the limit below that, CompiledStep raises it and
    torch never reports running a function eager past it."""
    torch._dynamo.reset()
    model, method, opt = setup("reweight", {"mode": "bk"})
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
        step = CompiledStep(method, "default", CPU, physical=(8, 16), backend="eager")
        for n in (16, 5, 12):  # eager, then sizes 8 and 16: each hook twice per module
            step(model, loss_fn, x[:n], y[:n], opt, sample_rate=0.01, expected_batch_size=20.0)
    assert step.compiled is not None
    assert not [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]


class ReplayedGraph:
    """Emulates a CUDA graph's replay (compile=reduce-overhead|cudagraphs) on the CPU: the same output tensors every
    call, overwritten in place by the next, and the chunk's gradients left in p.grad as the same static tensors (what
    the autograd engine keeps when the graph's backward returns them). Each call must follow a
    cudagraph_mark_step_begin."""

    def __init__(self, fn, marks):
        self.fn, self.marks, self.seen = fn, marks, len(marks)
        self.static = {}  # padded size -> (the gradients, losses, outputs, norms): one graph's memory per size

    def __call__(self, model, loss_fn, xp, yp, mask):
        assert len(self.marks) > self.seen, "a replay without cudagraph_mark_step_begin"
        self.seen = len(self.marks)
        out = self.fn(model, loss_fn, xp, yp, mask)
        params = [p for p in model.parameters() if p.grad is not None]
        fresh = [p.grad for p in params] + [out.losses, out.outputs, out.norms]
        static = self.static.setdefault(len(yp), [t.clone() for t in fresh])
        for s, t in zip(static, fresh):
            s.copy_(t)
        for p, s in zip(params, static):
            p.grad = s
        return Privatized(*static[len(params):])


@pytest.mark.parametrize("mode", ["reduce-overhead", "cudagraphs"])
def test_cuda_graph_output_reuse_leaves_the_chunked_sum_unchanged(mode, monkeypatch):
    """Chunks of 2 (physical_batch_size=2) of a batch of 5 under a CUDA-graph mode equal the eager unchunked step:
    the first chunk's gradients and every chunk's losses and norms are copied before the next replay (issue 31: the
    running total kept the first chunk's static outputs, which the next replay overwrote)."""
    import runner.methods.compiled as compiled

    marks = []
    monkeypatch.setattr(compiled.torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: ReplayedGraph(fn, marks))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)

    def two_steps(chunked):
        model, method, opt = setup("reweight", {"mode": "bk"})
        if chunked:
            method.configure(physical_batch_size=2)
            step = CompiledStep(method, mode, torch.device("cuda"), physical=2)  # a CUDA-graph mode (no CUDA used)
            assert step.mode == mode
        else:
            step = method.step
        noise = torch.Generator().manual_seed(3)
        outs = [step(model, loss_fn, x, y, opt, sample_rate=0.05, expected_batch_size=4.0, generator=noise)
                for _ in range(2)]
        return [p.detach() for p in model.parameters()], outs[-1]

    want, want_out = two_steps(chunked=False)
    got, got_out = two_steps(chunked=True)
    assert len(marks) == 3  # the second step's chunks of 2, 2, 1 (the first step runs eager)
    assert_close_params(got, want)
    torch.testing.assert_close(got_out.losses, want_out.losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_out.norms, want_out.norms, rtol=1e-5, atol=1e-6)


def test_a_graph_inductor_does_not_capture_is_named_in_one_line(caplog, monkeypatch):
    """compile=reduce-overhead whose graph Inductor runs without CUDA graphs (its "skipping cudagraphs due to ..."
    warning, which torch prints among its own): dprun's log says so once, with the reason, the step keeps its
    compiled kernels, and bench-clip's row carries the reason (the H100's compiled GPT-2 bk step, stop 32: 3.1x the
    compiled non-private one, 409 operators launched a step against 21, and the reason lost in torch's output)."""
    import torch._inductor.cudagraph_utils as cudagraph_utils

    from runner.bench.common import contender

    reason = "skipping cudagraphs due to mutated inputs (1 instances). Found from : File x.py, line 1"

    def skipping(gm, inputs):  # a backend that, like Inductor's CUDA-graph path, logs why it did not capture
        cudagraph_utils.log_cudagraph_skip_and_bump_counter(reason)
        return gm.forward

    def make(m):
        return CompiledStep(m, "reduce-overhead", torch.device("cuda"), physical=8, backend=skipping)

    torch._dynamo.reset()
    ref, _, _ = train("reweight", {"mode": "bk"}, lambda m: m.step)
    with caplog.at_level(logging.WARNING, logger="dprun"):
        got, _, step = train("reweight", {"mode": "bk"}, make)
    assert step.compiled is not None and step.mode == "reduce-overhead"
    assert step.cudagraph_skips == [reason.splitlines()[0]]
    one_line(caplog, "compile=reduce-overhead for method=reweight: Inductor runs a graph without CUDA graphs "
                     "(skipping cudagraphs due to mutated inputs")
    assert_close_params(got, ref)

    # the bench's contender: compiled (a row, timed) with the reason as its note
    torch._dynamo.reset()
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    import runner.methods.compiled as compiled

    original = compiled.CompiledStep.__init__

    def with_skipping_backend(self, method, mode, device, physical, backend=None):
        original(self, method, mode, torch.device("cuda"), physical, backend=skipping)

    monkeypatch.setattr(compiled.CompiledStep, "__init__", with_skipping_backend)
    c, note = contender("reweight", {"mode": "bk"}, model, x, y, lambda ps: torch.optim.SGD(ps, lr=0.1), 0.01, 8.0,
                        compile_mode="reduce-overhead")
    assert c is not None and note == "no CUDA graph: " + reason.splitlines()[0]


def test_a_failure_after_the_noise_is_not_retried(caplog):
    """An exception once the update began (noise added, the optimizer stepping) is raised, not retried eagerly: a
    retry would release the same Poisson batch with fresh noise a second time, and the step is accounted once
    (review 37). One noise draw, no fallback to eager."""
    model, method, _ = setup("reweight", {"mode": "bk"})
    step = CompiledStep(method, "default", CPU, physical=8)
    step.validated = True
    step.compiled = method.privatize  # the compiled chunk stands in for itself: only what follows it matters here

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("out of memory in the optimizer's state")

    draws = []
    real = method.update

    def update(*args, **kwargs):
        draws.append(1)
        return real(*args, **kwargs)

    method.update = update
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    with caplog.at_level(logging.WARNING, logger="dprun"), pytest.raises(RuntimeError, match="optimizer's state"):
        step(model, loss_fn, x, y, Failing(model.parameters(), lr=0.1), sample_rate=0.01, expected_batch_size=5.0)
    assert draws == [1] and method.released
    assert step.mode == "default" and "running the eager step" not in caplog.text


def test_a_broken_collective_is_not_taken_for_a_failed_compilation(caplog):
    """Review 54: on two ranks a peer killed (or late) made the all_reduce inside the compiled step raise before the
    noise; the fallback logged a failed compilation and ran the step again eagerly, a second all_reduce for one step
    (on a transport that survives, it could pair with the peer's next one). Re-raised now; the run reports the peer.
    And gloo's timeout wording is recognised as a peer's."""
    from runner.distributed import World, broken_collective

    model, method, _ = setup("reweight", {"mode": "bk"})
    method.world = World(rank=0, size=2)
    step = CompiledStep(method, "default", CPU, physical=8)
    step.validated = True

    def gone(*_):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    step.compiled = gone
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="dprun"), pytest.raises(RuntimeError, match="Connection closed"):
        step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=5.0)
    assert step.mode == "default" and "running the eager step" not in caplog.text
    assert broken_collective(RuntimeError("Application timeout caused pair closure"))
