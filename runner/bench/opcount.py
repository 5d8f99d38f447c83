"""Operators per training step: a device-independent proxy for launch overhead, counted on the CPU.

    ops = op_counts(step)        # {"aten_ops": every aten operator called (nested ones too, torch.profiler),
                                 #  "leaf_ops": aten operators that call no other aten operator}
    n = kernels(step)            # computing operators as the backends receive them (not views): eager steps only

On a GPU a small model's step is bound by Python and kernel launches, not math (issue 12: the MNIST CNN step takes
2.9 ms eager and 0.29 ms captured in a CUDA graph), so fewer operators per step is fewer launches. Profiler
bookkeeping events (names not starting with "aten::") are not counted.

`leaf_ops` depends on the CPU's own implementations: a CPU mm or norm calls resolve_conj, as_strided, empty,
copy_ ... (each a leaf) and is not itself one, so it over-counts what a GPU launches (GPT-2-small's bk step: 883
leaves, 60% views, metadata and allocations). `kernels` counts what a TorchDispatchMode sees below autograd and
above the backends: every operator a backend implements (mm, bmm, linalg_vector_norm, mul_ ... each about one
kernel on a GPU), leaving out views and metadata-only operators (VIEWS), which launch nothing. Eager steps only: under
a dispatch mode a torch.compile'd function runs its operators one by one, so the count would not be its kernels.
"""
from __future__ import annotations

from typing import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# operators that only make a view or read metadata: no kernel on any device
VIEWS = frozenset({"view", "_unsafe_view", "_reshape_alias", "as_strided", "permute", "transpose", "t", "expand",
                   "unsqueeze", "squeeze", "select", "slice", "alias", "reshape", "detach", "unbind", "split",
                   "split_with_sizes", "narrow", "movedim", "view_as", "diagonal", "unfold", "lift_fresh",
                   "_to_copy_view", "expand_as", "flatten", "unflatten", "chunk", "real", "view_as_real",
                   "_reshape_copy_view", "resolve_conj", "resolve_neg", "result_type", "size", "stride", "dim",
                   "is_contiguous", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "numel"})


class _Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def kernels(step: Callable[[], object], before: Callable[[], object] | None = None) -> int:
    """Computing operators of one step (not views), as the backends receive them: ~ kernels launched on a GPU."""
    if before is not None:
        before()
    with _Kernels() as mode:
        step()
    return mode.count


def op_counts(step: Callable[[], object], before: Callable[[], object] | None = None) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    if before is not None:
        before()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return {"aten_ops": len(events), "leaf_ops": len(leaves)}
