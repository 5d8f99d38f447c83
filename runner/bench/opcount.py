"""Operators dispatched per training step, counted with torch.profiler: a device-independent proxy for launch overhead.

    ops = op_counts(step)        # {"aten_ops": every aten operator called (nested ones too),
                                 #  "leaf_ops": aten operators that call no other aten operator ~ kernels launched}

On a GPU a small model's step is bound by Python and kernel launches, not math (issue 12: the MNIST CNN step takes
2.9 ms eager and 0.29 ms captured in a CUDA graph), and every leaf operator is about one kernel launch, so fewer
leaf operators per step is fewer launches. The count does not depend on the device's speed, so it can be measured
on the CPU. Profiler bookkeeping events (names not starting with "aten::") are not counted.
"""
from __future__ import annotations

from typing import Callable



def op_counts(step: Callable[[], object], before: Callable[[], object] | None = None) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    if before is not None:
        before()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return {"aten_ops": len(events), "leaf_ops": len(leaves)}
