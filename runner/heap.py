"""The C heap on a CPU run: keep what a step frees for the next step (issue 31's page faults).

A private step frees more, and larger, blocks than a non-private one (book-keeping's records, per-example
gradients). glibc's malloc hands big blocks back to the kernel (mmap'ed blocks above M_MMAP_THRESHOLD, and the top of
the heap above M_TRIM_THRESHOLD), so the next step touches fresh pages: measured on the bench's LSTM and transformer,
6,200 and 10,000 minor page faults per bk step (2-26 ms of system time), none for the non-private step, and ratios
that moved with the heap's history. `retain_freed_memory()` raises both thresholds to 1 GiB with mallopt (the same
as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment, but from inside the process): blocks freed by
one step are reused by the next, as PyTorch's CUDA caching allocator does on a GPU. The process keeps its peak
resident memory, which a training loop reaches every step anyway.

    retain_freed_memory()      # True where it applied (Linux, glibc); a no-op elsewhere
    minor_page_faults()        # this process's minor page faults so far (the bench's faults_per_step)

runner/assembly.py calls it for every run whose model is on the CPU (the CLI's and make_private's alike), and every
bench does (docs/bench.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import resource

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
RETAIN_BYTES = 2**30
_applied = False


def retain_freed_memory() -> bool:
    """mallopt(M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, 1 GiB) in glibc; False where there is no glibc."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    _applied = bool(mallopt(M_MMAP_THRESHOLD, RETAIN_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, RETAIN_BYTES))
    return _applied


def minor_page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
