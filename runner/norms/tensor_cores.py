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
- the clipped sum needs nu_i g_i in bf16, which rounds (2^-8 relative): by default (DPRUN_TENSOR_CORES_SUM=split)
  it is split, hi = bf16(nu g), lo = bf16(nu g - hi), and summed as two GEMMs; what is left out is at most
  SPLIT_LOSS |nu g| per entry, so example i's summed gradient is off from nu_i G_i by at most SPLIT_LOSS nu_i S_i
  (S_i = sum_t ||a_t|| ||g_t||), and the norm rule adds SPLIT_LOSS S_i to its certified ||G_i||
  (runner/norms/outer.py). Over-clipping: ~1e-5 relative. DPRUN_TENSOR_CORES_SUM=single sums bf16(nu g) in ONE GEMM
  (the split's second weight-gradient-sized GEMM a Linear is a third of GPT-2-small's non-private step) and the
  bound adds SINGLE_LOSS S_i instead (2^-8: ~0.4% more clipping on the transformers' layers, S_i / ||G_i|| ~ 1.5
  measured at initialisation); an example not clipped (nu = 1) has bf16(g) = g, no rounding at all.

Anywhere else (the CPU, float32 records, torch without out_dtype GEMMs) the records are upcast as before. The tests run
the same arithmetic on the CPU (EMULATE: bf16 operands multiplied exactly in float32 and accumulated in float32).

When (DPRUN_TENSOR_CORES: "auto", the default; "1" always; "0" never): "auto" takes the route in a compiled step
only. An eager step is bound by the CPU launching its operators, and the route adds ~3,900 on GPT-2-small (casts, the
split, two GEMMs a layer): H100, T = 512, B = 8, bf16, the eager bk step took 146.5 ms with it and 99.8 ms without,
though its kernels took 40.0 ms of device time against 56.1. A compiled step (compile=reduce-overhead) replays its
graphs with no launches to pay for: GPT-2-small, T = 128, B = 32, bf16, its compiled bk step took 18.76 ms with the
route on an H100 (1.55x the compiled non-private step, 12.10 ms; stop 41) against 35.11 ms without it on an H200
(3.29x its 10.66 ms; stop 40), a card that is never slower than the H100 (the same GH100 compute, faster memory).
The route is fixed once per step (CallHooks.tensor_cores, when the step's recorder is made): a layer's norm and its
clipped sum are formed from the same records, whichever route that is.
"""
from __future__ import annotations

import os

import torch

from runner.errors import DprunError
from runner.norms import certify

U_ACCUMULATE = 2.0**-22  # tensor-core float32 accumulation, taken as 4x float32's unit roundoff (see above)
# hi rounds t = nu g (float32, itself rounded: 2^-24) to bf16 (2^-8 |t|); t - hi is exact (Sterbenz) and lo rounds
# it (2^-8 of it): hi + lo misses nu g by < 2^-16 + 2^-24 relative, and by < 2^-133 absolute where lo underflows
# (bf16 has float32's exponent range; negligible beside any C in use)
SPLIT_LOSS = 2.0**-15
# one rounding of the float32 nu g (itself within 2^-24 of nu g) to bf16's 8 significant bits: within
# (1 + 2^-24)(1 + 2^-8) - 1 < 2^-8 + 2^-23 relative (and 2^-134 absolute where it underflows: negligible, as above)
SINGLE_LOSS = 2.0**-8 + 2.0**-23
SUMS = {"split": "two bf16 GEMMs, hi + lo, each example within 2^-15 S_i of nu_i G_i (the default)",
        "single": "one bf16 GEMM of bf16(nu g), within 2^-8 S_i, which the bound adds (more clipping, one GEMM fewer)"}
# the clipped sums' form, read once, when this module is imported (a step's norms and sums must agree on it)
SUM = os.environ.get("DPRUN_TENSOR_CORES_SUM", "").strip().lower() or "split"
EMULATE = False  # tests: take the tensor-core route on the CPU with float32 arithmetic of the bf16 operands


# torch.mm/bmm(bf16, bf16, out_dtype=float32) exist (torch >= 2.8; CUDA kernels): read once from the operator
# registry, a constant (no probe GEMM, which Dynamo would trace into every compiled step)
OUT_DTYPE_GEMM = all("dtype" in op.overloads() for op in (torch.ops.aten.mm, torch.ops.aten.bmm))


MODES = {"auto": "in a compiled step only (the default)", "1": "always", "0": "never"}


def mode() -> str:
    """DPRUN_TENSOR_CORES from the environment ("auto" when unset or empty); any other value is refused in one line."""
    value = os.environ.get("DPRUN_TENSOR_CORES", "").strip().lower() or "auto"
    if value not in MODES:
        raise DprunError(f"DPRUN_TENSOR_CORES={value!r} is not a mode; use one of: "
                         + ", ".join(f"{m} ({why})" for m, why in MODES.items()))
    return value


def enabled(compiled: bool | None = None) -> bool:
    """Is the route on for a step? "1", or "auto" in a compiled step (`compiled`, by default
    torch.compiler.is_compiling(): the step is being traced now); always in the tests' EMULATE. Where it is on, a bf16
    record still takes it only on CUDA (used_for)."""
    value = mode()
    if compiled is None:
        compiled = torch.compiler.is_compiling()
    return EMULATE or value == "1" or (value == "auto" and compiled)


def used_for(g: torch.Tensor) -> bool:
    """A layer whose output-gradient `g` is bf16 on CUDA (precision=bf16) can take the tensor-core route (where the
    step's route is on: enabled())."""
    if g.dtype != torch.bfloat16:
        return False
    return EMULATE or (g.is_cuda and OUT_DTYPE_GEMM)


def records(inp: torch.Tensor, grad: torch.Tensor, tensor_cores: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's (input, output-gradient) as its rule will use them: bf16 both for the tensor-core route (`tensor_cores`:
    the rule takes it and the step's route is on; a float32 input cast as autocast casts it for the layer's GEMM), else
    float32 both (the bf16 ones upcast, exactly)."""
    if tensor_cores and used_for(grad):
        return inp.to(torch.bfloat16) if inp.is_floating_point() else inp, grad
    return to_float32(inp), to_float32(grad)


def to_float32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bf16/fp16 tensor upcast to float32 (exact); anything else (float32, ids, None: a stash-only layer) as is."""
    if t is not None and t.is_floating_point() and t.dtype in (torch.bfloat16, torch.float16):
        return t.float()
    return t


def norms(t: torch.Tensor, dim) -> torch.Tensor:
    """torch.linalg.vector_norm of a bf16 t computed in float32 (its entries upcast exactly), float32; rows of one
    entry as a root of their square, so a record above ~1e19 overflows as in longer rows (certify.vector_norms)."""
    if certify._one_entry(t, dim):
        return t.float().square().sum(dim).sqrt_()
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


def sum_mode() -> str:
    """DPRUN_TENSOR_CORES_SUM as read at import ("split" unless set); any other value refused in one line."""
    if SUM not in SUMS:
        raise DprunError(f"DPRUN_TENSOR_CORES_SUM={SUM!r} is not a mode; use one of: "
                         + ", ".join(f"{m} ({why})" for m, why in SUMS.items()))
    return SUM


def sum_loss() -> float:
    """What the clipped sum's bf16 operand may miss of nu g, relative per entry: the slack each norm bound adds."""
    return SPLIT_LOSS if sum_mode() == "split" else SINGLE_LOSS


def summands(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 t (nu g) as the bf16 operands of the clipped sum: (hi, lo) from split, or (bf16(t),) for "single"."""
    return split(t) if sum_mode() == "split" else (t.to(torch.bfloat16),)


def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 t -> (hi, lo) bf16 with |t - hi - lo| <= 2^-16 |t| elementwise (hi rounds t, lo what is left)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)
