"""`compile=off|default|reduce-overhead|cudagraphs`: each chunk's private work (forward, per-example norms, clipping,
backward: Method.privatize) run under torch.compile, on chunks padded (runner/methods/padding.py, eager) to one of a
few fixed physical sizes, one graph per size (dynamic=False); the chunks' sum, the all-reduce over ranks, the noise
and the optimizer update (a few foreach kernels) run eager around it, in Method.step.

    step = build_step(method, mode="default", device=torch.device("cpu"), physical=buckets(B))
    out = step(model, loss_fn, x, y, optimizer, sample_rate=q, expected_batch_size=B)    # as Method.step

The physical sizes: physical_batch_size when it is set (every chunk padded to it: one graph), else buckets(B): the
whole Poisson batch is one chunk, padded to the smallest of at most 5 sizes B + k sqrt(B) (k = -1, 0, 1, 2, 4,
rounded up to multiples of 8) that holds it: one graph per size, fewer than 2 sqrt(B) + 8 padded rows for a batch
above B - sqrt(B), on average 13% more rows at B = 32, 3% at B = 256 (one size B + 4 sqrt(B) padded 75% and 25%).
The padding runs eager, outside the compiled function, whose inputs then have one shape per size.

    off              Method.step, eager (the default)
    default          torch.compile(mode="default"): TorchInductor, CPU or CUDA
    reduce-overhead  torch.compile(mode="reduce-overhead"): Inductor + CUDA graphs (CUDA only)
    cudagraphs       torch.compile(backend="cudagraphs"): the eager kernels replayed from a captured CUDA graph
                     (CUDA only)

precision=tf32 on CUDA is refused for a private method (one line; on the CPU tf32 changes nothing): AOTAutograd's
graph keeps aten ops only, so the TF32-off switch around the norms and clipped sums (certify.exact_float32, a
torch.backends flag set at run time) is gone from what Inductor compiles, and every product in the graph would run
under the step's TF32 setting (tests/test_tf32.py shows the switch vanishing). Never silent: a mode that needs CUDA
on another device runs compile=default instead, a method that is not
compiled (Method.compiles) runs eager, and a step whose compilation fails runs eager from then on; each logs ONE line.
Dynamo traces the chunk's backward (torch.autograd.grad) into the graph (in_one_graph), and reweight's
book-keeping takes its traceable route (Recorder, with the forward hooks installed before tracing), so a bk chunk is
one graph per physical size; a method whose work still breaks the graph runs in several parts, compiled or eager,
and every part gives the eager step's numbers to float rounding (tests/test_compiled.py). Dynamo's
recompile limits are raised to hold one graph per size (else sizes past the limit would run eager, logged by torch).
The CUDA-graph modes return their outputs (losses, norms, the chunk's gradients in p.grad) in the graph's static
memory, which the next replay overwrites: the losses, outputs and norms are copied after each replay, and
Method.clipped_sum copies the running sum of the chunks' gradients before a second chunk runs (GraphOutputs).
The first step runs eager: it validates the model (e.g. reweight's in-place check, which cannot be made inside a
compiled graph). Random draws inside the graph (dropout) come from torch's own generator, as eager
(torch._inductor.config.fallback_random); JL's directions and the noise are drawn eagerly, once per logical step.
A graph Inductor compiles but does not capture in a CUDA graph (it logs "skipping cudagraphs due to ..." among
torch's warnings) is named in one line of dprun's log and in bench-clip's note column (CudagraphSkips): the step
then still launches every kernel from the host. On an H100 (stop 32, torch 2.11, GPT-2-small bf16, T = 128,
B = 32) the compiled non-private step was replayed (12.2 ms, 21 operators a step) and the compiled bk step was not
(37.8 ms, 3.1x, 419 operators); its reason was lost in the output then. Inspected on the CPU since (stop 34), the
bk graph held one CPU tensor constant, the 0 of the embedding rule's `w[padding_idx] = 0`, a "cpu device" skip on a GPU:
removed, and tests/test_cudagraph_ready.py checks every compiled chunk for the reasons Inductor skips (not yet
confirmed on a GPU). The CPU tests emulate CUDA graphs' output reuse and the skip (tests/test_compiled.py).
"""
from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence

import torch

from runner.distributed import broken_collective
from runner.errors import DprunError
from runner.methods.base import METHODS, Privatized
from runner.methods.padding import masked, padded

log = logging.getLogger("dprun")

MODES = ("off", "default", "reduce-overhead", "cudagraphs")
CUDA_ONLY = ("reduce-overhead", "cudagraphs")


# the sizes' offsets from the expected batch size B in standard deviations sqrt(B) of a Poisson batch's size: a batch
# is above B - sqrt(B) 84% of the time, above B + 4 sqrt(B) less than once in 10^4
SPREAD = (-1, 0, 1, 2, 4)


def buckets(expected_batch_size: float) -> tuple[int, ...]:
    """The physical sizes for Poisson batches of mean B: B + k sqrt(B) for k in SPREAD, rounded up to multiples of 8,
    the same ones merged (1 to 5 sizes: 4 or 5 from B = 24 on). A batch of n rows runs at the smallest size >= n
    (padding.bucket): with n > B - sqrt(B), fewer than 2 sqrt(B) + 8 padded rows (two sizes lie at most
    2 sqrt(B) + 8 apart); a smaller batch at the lowest size, <= B - sqrt(B) + 8; a batch above the top size
    B + 4 sqrt(B) at its own size (not truncated: one more graph). On average 13% more rows at B = 32, 6% at 64,
    3% at 256, 1.7% at 1024."""
    B = max(float(expected_batch_size), 1.0)
    return tuple(sorted({8 * math.ceil(max(B + k * math.sqrt(B), 1.0) / 8) for k in SPREAD}))


def check_mode(mode: str) -> str:
    mode = str(mode)
    if mode in ("False", "false", "None", "none"):  # YAML reads a bare `off` as False
        mode = "off"
    if mode not in MODES:
        raise DprunError(f"unknown compile={mode!r}; valid: {', '.join(MODES)}")
    return mode


class GraphOutputs:
    """A CUDA-graph-compiled core(model, loss_fn, xp, yp, mask): each call is marked as a new replay
    (torch.compiler.cudagraph_mark_step_begin) and returns copies of its (P,) losses, (P, classes) outputs and (P,)
    norms, which live in the graph's static memory until the next replay overwrites them (cudagraph trees then raise
    "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"). The chunk's gradients
    (p.grad) live there too: Method.clipped_sum copies the running sum before a second chunk runs when the chunk's
    privatize says so (overwrites_outputs)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, model, loss_fn, xp, yp, mask) -> Privatized:
        torch.compiler.cudagraph_mark_step_begin()  # a new replay: the previous one's outputs may be overwritten
        out = self.core(model, loss_fn, xp, yp, mask)
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        return Privatized(copy(out.losses), copy(out.outputs), copy(out.norms), copy(out.consistent))


class CudagraphSkips(logging.Handler):
    """The reasons Inductor gives for running a compiled graph WITHOUT CUDA graphs under a CUDA-graph mode ("skipping
    cudagraphs due to mutated inputs", "... cpu device", ...): torch logs them as warnings among its own, easily
    missed, and the step then keeps every kernel launch (bench-clip's aten_ops column shows it). Collected while
    attached, so that CompiledStep can say so in one line of dprun's log and the bench in its note column."""

    LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"  # torch's artifact logger for them (cudagraph_utils.py)

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip().splitlines()[0][:300] if record.getMessage().strip() else ""
        if message.startswith("skipping cudagraphs") and message not in self.reasons:
            self.reasons.append(message)

    def __enter__(self):
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)


def raise_recompile_limit(sizes: int, modules: int) -> None:
    """Room in Dynamo's caches for every graph the step compiles, so that none runs eager past a limit (which torch
    only logs): a function compiles once per physical size, and a per-module norm hook (reweight's, compiled with the
    step) once per size and module, plus the default's 8 others (a batch above the top size, a changed guard)."""
    import torch._dynamo.config as dynamo_config

    per_function = sizes * (modules + 8)
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), per_function))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):  # over all functions: several hooks per module
        dynamo_config.accumulated_recompile_limit = max(int(dynamo_config.accumulated_recompile_limit),
                                                        8 * per_function)


def in_one_graph(core):
    """core, called with Dynamo tracing torch.autograd.grad (book-keeping's one backward, Recorder.backprops) into
    the graph, so a compiled bk chunk is ONE graph: forward, backward to the recorded outputs, norms, clip factors and
    clipped sums (a CUDA-graph mode then replays all of it). Without it the grad is a graph break deep in nested
    calls, from which Dynamo cannot resume: it ran the rest of the book-keeping eagerly, each layer's rule a graph of
    its own (20 graphs for a 2-block transformer; the compiled bk step slower than the eager one). Where torch lacks
    the option: nested_graph_breaks (resume inside the nested calls: two graphs around an eager backward). The
    option holds only during the call (Dynamo traces then), not for the rest of the process."""
    import torch._dynamo.config as dynamo_config

    option = next((o for o in ("trace_autograd_ops", "nested_graph_breaks") if o in dynamo_config._config), None)
    if option is None:
        return core

    def call(*args, **kwargs):
        with dynamo_config.patch(**{option: True}):
            return core(*args, **kwargs)

    return call


class CompiledStep:
    """Callable like Method.step; compiles on the first call, falls back to eager (one log line) on failure.
    physical: the chunk's padded size, or several (buckets(): the smallest that holds the chunk)."""

    def __init__(self, method, mode: str, device: torch.device, physical: int | Sequence[int],
                 backend: str | None = None):
        self.method = method
        self.physical = (int(physical),) if isinstance(physical, int) else tuple(sorted(int(p) for p in physical))
        self.requested = mode = check_mode(mode)
        if mode in CUDA_ONLY and device.type != "cuda":
            log.warning("compile=%s needs CUDA (CUDA graphs); on %s using compile=default", mode, device.type)
            mode = "default"
        if mode != "off" and not method.compiles:
            log.warning("compile=%s: method=%s is not compiled (compiled: %s); running the eager step",
                        mode, method.name, ", ".join(n for n, m in METHODS.items() if m.compiles))
            mode = "off"
        if mode != "off" and method.private and method.precision == "tf32" and device.type == "cuda":
            raise DprunError(f"compile={self.requested} cannot run with precision=tf32 for method={method.name}: a "
                             f"compiled graph drops the switch that turns TF32 off around the norms and clipped sums "
                             f"(AOTAutograd keeps aten ops only), so they would take TF32's 10-bit products and an "
                             f"example could exceed C; use precision=fp32 or bf16 with compile, or compile=off")
        self.mode = mode
        if mode == "off":
            self.physical = None  # eager: no padding
        self.compiled, self.validated = None, False
        self.cudagraph_skips: list[str] = []  # Inductor's reasons for not capturing a graph (CUDA-graph modes)
        if mode != "off":
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True  # randn in the graph = torch's generator, as eager
            # torch's own deprecation inside Inductor's lowering (torch 2.13), printed at every compilation: not the user's
            warnings.filterwarnings("ignore", message=r"`torch\._prims_common\.check` is deprecated",
                                    category=FutureWarning)
            kwargs = {"backend": "cudagraphs"} if mode == "cudagraphs" else {"mode": mode}
            if backend is not None:  # tests: backend="eager" traces the step with Dynamo but runs eager kernels
                kwargs = {"backend": backend}
            # compiled: the padded chunk's work, whose inputs have one of the physical sizes (one graph each); the
            # padding and the slicing back to the real rows run eager around it (padding.padded)
            core = in_one_graph(torch.compile(masked(method.privatize), dynamic=False, **kwargs))
            method.traced = True  # its traceable route (reweight: Recorder), also in a frame Dynamo runs eagerly
            if mode in CUDA_ONLY:
                core = GraphOutputs(core)
            self.compiled = padded(method.privatize, self.physical, core)
            method.padding_sizes = self.physical  # the first-step check probes the rows through this padding
            self.compiled.overwrites_outputs = mode in CUDA_ONLY  # read by Method.clipped_sum
            model = method.model  # attached: its modules' norm hooks compile with the step
            raise_recompile_limit(len(self.physical), len(list(model.modules())) if model is not None else 0)
            if len(self.physical) > 1:
                log.info("compile=%s: each Poisson batch padded to the smallest of %d sizes (%s rows), one graph each",
                         mode, len(self.physical), ", ".join(map(str, self.physical)))

    def __call__(self, model, loss_fn, x, y, optimizer, **kw):
        if self.compiled is None or not self.validated:
            self.validated = True  # the first step eager: it validates the model (one-line errors)
            return self.method.step(model, loss_fn, x, y, optimizer, **kw)
        try:
            if self.mode not in CUDA_ONLY:
                return self.method.step(model, loss_fn, x, y, optimizer, privatize=self.compiled, **kw)
            with CudagraphSkips() as skips:  # compilation (a new physical size's graph) happens inside this call
                out = self.method.step(model, loss_fn, x, y, optimizer, privatize=self.compiled, **kw)
            for reason in skips.reasons:
                if reason not in self.cudagraph_skips:
                    self.cudagraph_skips.append(reason)
                    log.warning("compile=%s for method=%s: Inductor runs a graph without CUDA graphs (%s); every "
                                "kernel is still launched from the host", self.mode, self.method.name, reason)
            return out
        except DprunError:
            raise
        except Exception as e:  # the chunk's compilation failed: eager from now on, logged once
            if self.method.released:  # raised after the noise (the optimizer's step): the batch is released; the
                raise  # eager retry would release it a second time, accounted once (review 37)
            if self.method.world.size > 1 and broken_collective(e):  # a peer gone or late, not the compilation: a
                raise  # retry's second all_reduce could pair with the peer's next one (review 54); the run reports it
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("compile=%s failed for method=%s (%s: %s); running the eager step from now on",
                        self.mode, self.method.name, type(e).__name__, first)
            self.compiled, self.mode, self.physical = None, "off", None
            self.method.traced = False
            optimizer.zero_grad(set_to_none=True)
            return self.method.step(model, loss_fn, x, y, optimizer, **kw)


def build_step(method, mode: str, device: torch.device, physical: int | Sequence[int] | None = None):
    """The step callable for compile=`mode`: method.step itself when off (no padding), else a CompiledStep (which
    needs `physical`)."""
    if check_mode(mode) == "off":
        return method.step
    return CompiledStep(method, mode, device, physical)
