"""`compile=off|default|reduce-overhead|cudagraphs`: each chunk's private work (forward, per-example norms, clipping,
backward: Method.privatize) run under torch.compile, on chunks padded to one physical size (runner/methods/padding.py)
so that one graph serves every chunk of every Poisson batch; the chunks' sum, the all-reduce over ranks, the noise
and the optimizer update (a few foreach kernels) run eager around it, in Method.step.

    step = build_step(method, mode="default", device=torch.device("cpu"), physical=320)
    out = step(model, loss_fn, x, y, optimizer, sample_rate=q, expected_batch_size=B)    # as Method.step

The physical size: physical_batch_size when it is set (every chunk padded to it), else B + 4 sqrt(B) (the whole
Poisson batch is one chunk; physical_batch()).

    off              Method.step, eager (the default)
    default          torch.compile(mode="default"): TorchInductor, CPU or CUDA
    reduce-overhead  torch.compile(mode="reduce-overhead"): Inductor + CUDA graphs (CUDA only)
    cudagraphs       torch.compile(backend="cudagraphs"): the eager kernels replayed from a captured CUDA graph
                     (CUDA only)

Never silent: a mode that needs CUDA on another device runs compile=default instead, a method that is not
compiled (Method.compiles) runs eager, and a step whose compilation fails runs eager from then on; each logs ONE line.
Dynamo may split the chunk's work into several graphs (graph breaks, e.g. at the norm hooks); every part still
runs, compiled or eager, and gives the eager step's numbers to float rounding (tests/test_compiled.py).
The first step runs eager: it validates the model (e.g. reweight's in-place check, which cannot be made inside a
compiled graph). Random draws inside the graph (dropout) come from torch's own generator, as eager
(torch._inductor.config.fallback_random); JL's directions and the noise are drawn eagerly, once per logical step.
NOT YET MEASURED ON CUDA: reduce-overhead and cudagraphs are written for a GPU session (make bench-gpu).
"""
from __future__ import annotations

import logging
import math

import torch

from runner.errors import DprunError
from runner.methods.base import METHODS
from runner.methods.padding import padded

log = logging.getLogger("dprun")

MODES = ("off", "default", "reduce-overhead", "cudagraphs")
CUDA_ONLY = ("reduce-overhead", "cudagraphs")


def physical_batch(expected_batch_size: float) -> int:
    """A fixed physical size a Poisson batch of mean B rarely exceeds: B + 4 sqrt(B), rounded up to a multiple of 8
    (a larger batch runs at its own size: one more graph)."""
    b = expected_batch_size + 4 * math.sqrt(max(expected_batch_size, 1.0))
    return int(8 * math.ceil(b / 8))


def check_mode(mode: str) -> str:
    mode = str(mode)
    if mode in ("False", "false", "None", "none"):  # YAML reads a bare `off` as False
        mode = "off"
    if mode not in MODES:
        raise DprunError(f"unknown compile={mode!r}; valid: {', '.join(MODES)}")
    return mode


class CompiledStep:
    """Callable like Method.step; compiles on the first call, falls back to eager (one log line) on failure."""

    def __init__(self, method, mode: str, device: torch.device, physical: int | None, backend: str | None = None):
        self.method, self.physical = method, physical
        self.requested = mode = check_mode(mode)
        if mode in CUDA_ONLY and device.type != "cuda":
            log.warning("compile=%s needs CUDA (CUDA graphs); on %s using compile=default", mode, device.type)
            mode = "default"
        if mode != "off" and not method.compiles:
            log.warning("compile=%s: method=%s is not compiled (compiled: %s); running the eager step",
                        mode, method.name, ", ".join(n for n, m in METHODS.items() if m.compiles))
            mode = "off"
        self.mode = mode
        if mode == "off":
            self.physical = None  # eager: no padding
        self.compiled, self.validated = None, False
        if mode != "off":
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True  # randn in the graph = torch's generator, as eager
            kwargs = {"backend": "cudagraphs"} if mode == "cudagraphs" else {"mode": mode}
            if backend is not None:  # tests: backend="eager" traces the step with Dynamo but runs eager kernels
                kwargs = {"backend": backend}
            self.compiled = torch.compile(padded(method.privatize, physical), dynamic=False, **kwargs)

    def __call__(self, model, loss_fn, x, y, optimizer, **kw):
        if self.compiled is None or not self.validated:
            self.validated = True  # the first step eager: it validates the model (one-line errors)
            return self.method.step(model, loss_fn, x, y, optimizer, **kw)
        try:
            return self.method.step(model, loss_fn, x, y, optimizer, privatize=self.compiled, **kw)
        except DprunError:
            raise
        except Exception as e:  # the chunk's compilation failed: eager from now on, logged once
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("compile=%s failed for method=%s (%s: %s); running the eager step from now on",
                        self.mode, self.method.name, type(e).__name__, first)
            self.compiled, self.mode, self.physical = None, "off", None
            optimizer.zero_grad(set_to_none=True)
            return self.method.step(model, loss_fn, x, y, optimizer, **kw)


def build_step(method, mode: str, device: torch.device, physical: int | None = None):
    """The step callable for compile=`mode`: method.step itself when off (no padding), else a CompiledStep."""
    if check_mode(mode) == "off":
        return method.step
    return CompiledStep(method, mode, device, physical)
