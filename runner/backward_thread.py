"""The step's backward in the calling thread on CUDA (issue 26's budget, stop 40).

PyTorch's autograd engine runs a CUDA backward on a worker thread of its own (one per device) while the calling
thread waits. Book-keeping computes each layer's norm inside the backward, in Python tensor hooks
(runner/norms/streaming.py), so on CUDA every hook's Python ran on that worker thread, handed the GIL across
threads, and a host-bound step paid for it: on an H200 (torch 2.11, one process, 40 interleaved rounds, stop 40,
docs/bench.md) the reweight-bk step with the backward in the calling thread (`set_multithreading_enabled(False)`)
took 0.94 / 0.98 / 0.94 / 1.00x of the default's on bu_cnn / papernot_cnn / the transformer / ResNet-18, and the
non-private step 0.87 / 0.90 / 1.01 / 0.98x (the hand-over to the worker alone costs a small step ~0.3 ms). On an
H100 (stop 41, in one process, 30 rounds) the worker's bk step took 1.15 / 1.18 / 1.25x the calling thread's on
ResNet-18 / papernot_cnn / bu_cnn (docs/bench.md "On an H100 (stop 41)").
A single-device step gains nothing from the worker thread (the CPU and the device are still asynchronous: the
calling thread launches the same kernels); several ranks reduce after the backward (Method.clipped_sum), not in
hooks inside it. The CPU's backward already runs in the calling thread: nothing changes there.

A compiled step (compile=) is left as it is: its backward is one graph's (no Python hooks), and Inductor's CUDA
graph trees have their own per-thread state; not measured there.

    with backward_in_this_thread(x.device, compiled=False):
        losses.sum().backward()
"""
from __future__ import annotations

import contextlib

import torch

_NOTHING = contextlib.nullcontext()
# False: autograd's own device thread, as before stop 40 (`python -m runner.bench.threads` times the two in turn)
IN_CALLING_THREAD = True


def backward_in_this_thread(device: torch.device, compiled: bool = False):
    """A context in which autograd runs every backward in the calling thread: on CUDA for an eager step; a shared
    no-op elsewhere (the CPU's backward runs there already)."""
    if device.type != "cuda" or compiled or not IN_CALLING_THREAD or torch.compiler.is_compiling():
        return _NOTHING
    return torch.autograd.set_multithreading_enabled(False)
