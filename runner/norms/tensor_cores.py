"""precision=bf16 on a GPU: a Linear's norms and clipped sum as bf16 tensor-core GEMMs with float32 output (issue 31).

Under autocast a Linear's output-gradient is bf16 and its GEMMs ran on bf16 operands. Upcasting both records to
float32 (what every other rule does) puts the Grams, the per-example gradients and the clipped sum on float32 SIMT
units, ~10x slower than the non-private step's bf16 tensor-core GEMMs (an H100: 0.42 ms float32 vs 0.039 ms bf16 for
a (4096, 3072)^T (4096, 768) product). Here the records stay bf16 (an input that autocast would cast is cast the same
way: bf16(a) is what the layer's GEMM saw) and every product is `torch.mm/bmm(..., out_dtype=float32)`:

- products of two bf16 values are exact in float32 (8 + 8 significant bits); the accumulation is float32 inside the
  tensor cores, which do not add in IEEE order (blocks of products aligned and added with truncation: Fasi, Higham,
  Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021). The certificate uses
  U_ACCUMULATE = 2^-22 (4x float32's unit roundoff) in every gamma_n of a tensor-core reduction; measured on an H100
  (torch 2.11, bf16 inputs with cancelling terms, k = 64..16384): |error| <= 6.3e-7 sum|terms|, inside gamma_k.
- the clipped sum needs nu_i g_i in bf16, which rounds (2^-8 relative): it is split, hi = bf16(nu g),
  lo = bf16(nu g - hi), and summed as two GEMMs; what is left out is at most SPLIT_LOSS |nu g| per entry, so
  example i's summed gradient is off from nu_i G_i by at most SPLIT_LOSS nu_i S_i (S_i = sum_t ||a_t|| ||g_t||), and
  the norm rule adds SPLIT_LOSS S_i to its certified ||G_i|| (runner/norms/outer.py). Over-clipping: ~1e-5 relative.

Anywhere else (the CPU, float32 records, torch without out_dtype GEMMs) the records are upcast as before. The tests run
the same arithmetic on the CPU (EMULATE: bf16 operands multiplied exactly in float32 and accumulated in float32).

Opt-in (DPRUN_TENSOR_CORES=1), from what an H100 showed (torch 2.11, python -m runner.bench.profile and bench-clip,
GPT-2-small stack, T = 512, B = 8, bf16): the bk step's kernels took 40.0 ms of device time with it, 56.1 ms without
(the float32 SIMT GEMMs gone), but the eager step took 146.5 ms of wall time with it, 99.8 ms without: the step is
bound by the CPU launching ~11,000 operators, and the route adds ~3,900 (casts, the split, two GEMMs a layer). It
pays where the GPU is the bottleneck (a compiled step, larger batches): not measured yet (an H200, stop 40: the
compiled bf16 bk step of GPT-2-small is replayed from CUDA graphs, 3.29x the compiled non-private step on the
float32 route; `make device-check` times this route there).
"""
from __future__ import annotations

import functools
import os

import torch

U_ACCUMULATE = 2.0**-22  # tensor-core float32 accumulation, taken as 4x float32's unit roundoff (see above)
# hi rounds t = nu g (float32, itself rounded: 2^-24) to bf16 (2^-8 |t|); t - hi is exact (Sterbenz) and lo rounds
# it (2^-8 of it): hi + lo misses nu g by < 2^-16 + 2^-24 relative, and by < 2^-133 absolute where lo underflows
# (bf16 has float32's exponent range; negligible beside any C in use)
SPLIT_LOSS = 2.0**-15
EMULATE = False  # tests: take the tensor-core route on the CPU with float32 arithmetic of the bf16 operands


@functools.cache
def _out_dtype_gemm() -> bool:
    """torch.mm(bf16, bf16, out_dtype=float32) exists on this CUDA build (torch >= 2.8)."""
    if not torch.cuda.is_available():
        return False
    try:
        x = torch.ones(8, 8, dtype=torch.bfloat16, device="cuda")
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def enabled() -> bool:
    """DPRUN_TENSOR_CORES=1 in the environment: opt-in (measured on an H100 below: less device time, more wall time
    in an eager step that is bound by the CPU's kernel launches)."""
    return os.environ.get("DPRUN_TENSOR_CORES", "0") == "1"


def used_for(g: torch.Tensor) -> bool:
    """A layer whose output-gradient `g` is bf16 on CUDA (precision=bf16) takes the tensor-core route when enabled()."""
    if g.dtype != torch.bfloat16:
        return False
    return EMULATE or (enabled() and g.is_cuda and _out_dtype_gemm())


def records(inp: torch.Tensor, grad: torch.Tensor, tensor_cores: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's (input, output-gradient) as its rule will use them: bf16 both for the tensor-core route (a float32
    input cast as autocast casts it for the layer's GEMM), else float32 both (the bf16 ones upcast, exactly)."""
    if tensor_cores and used_for(grad):
        return inp.to(torch.bfloat16) if inp.is_floating_point() else inp, grad
    return to_float32(inp), to_float32(grad)


def to_float32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bf16/fp16 tensor upcast to float32 (exact); anything else (float32, ids, None: a stash-only layer) as is."""
    if t is not None and t.is_floating_point() and t.dtype in (torch.bfloat16, torch.float16):
        return t.float()
    return t


def norms(t: torch.Tensor, dim) -> torch.Tensor:
    """torch.linalg.vector_norm of a bf16 t computed in float32 (its entries upcast exactly), float32."""
    return torch.linalg.vector_norm(t, dim=dim, dtype=torch.float32)


def mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y for bf16 x (m, n), y (n, p): float32 (m, p), products exact, float32 accumulation."""
    if x.is_cuda:
        return torch.mm(x, y, out_dtype=torch.float32)
    return x.float() @ y.float()


def bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y for bf16 x (N, m, n), y (N, n, p): float32 (N, m, p), as mm."""
    if x.is_cuda:
        return torch.bmm(x, y, out_dtype=torch.float32)
    return torch.bmm(x.float(), y.float())


def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 t -> (hi, lo) bf16 with |t - hi - lo| <= 2^-16 |t| elementwise (hi rounds t, lo what is left)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)
