"""`precision=fp32|bf16|tf32`: the forward and backward under torch.autocast (bf16) or with TF32 products on CUDA
(tf32, matmul_precision below); what makes the guarantee stays in float32.

    with autocast(device, "bf16"):            # the model's forward and the loss (methods wrap only these)
        losses = loss_fn(model(x), y)
    a, g = to_float32(a), to_float32(g)        # what a norm rule and its clipped sum are formed from
    factors = clip_factors(norms, C, margin=ROUNDING_MARGIN["bf16"])

The policy (jax_privacy's; docs/precision.md): matmuls and convolutions of the forward and backward in bfloat16;
the per-example norms, the clip factors, the clipped sums and their accumulation over chunks and ranks, the noise and
the optimizer update in float32 (the parameters and their .grad stay float32: autocast casts copies).

The guarantee must not depend on rounding: each example's contribution to the released sum must have norm <= C.
Under bf16 the recorded tensors are bf16 values upcast exactly to float32, and every norm is a certified float32
upper bound of the per-example gradient the clipped sum is formed from (runner/norms/certify.py, docs/privacy.md
"Certified clipping"), so the bound holds as in fp32; ROUNDING_MARGIN (the clip factor C / (norm (1 + margin) +
1e-6), 0.1% below) is kept on top. A method whose clipped sum comes from a second backward (reweight
twopass/recompute, Opacus ghost) or from norm estimates (jl) would round differently from the pass that measured
the norm: Method.unsupported refuses it under bf16 in one line. fp16 (loss scaling) is out of scope and refused by
the config check.
"""
from __future__ import annotations

import contextlib

import torch

from runner.fp32_mode import cpu_is_ieee, float32_mode

PRECISIONS = ("fp32", "bf16", "tf32")
AUTOCAST_DTYPE = {"bf16": torch.bfloat16}
_NOTHING = contextlib.nullcontext()
# relative margin on the norm in the clip factor: covers float32 rounding of a norm formed from bf16-rounded
# tensors (measured < 1e-5; see above); 0 in fp32, where the factor is the DESIGN's min(1, C / (norm + 1e-6))
ROUNDING_MARGIN = {"fp32": 0.0, "bf16": 1e-3, "tf32": 0.0}  # tf32: norms and sums stay exact float32


def autocast(device: torch.device | str, precision: str):
    """torch.autocast for a reduced precision on `device` (CUDA or CPU); a no-op context for fp32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPE[precision])


def to_float32(t: torch.Tensor) -> torch.Tensor:
    """A reduced-precision float tensor upcast to float32 (exact); float32/float64 and integer tensors unchanged."""
    if t.is_floating_point() and t.dtype in (torch.bfloat16, torch.float16):
        return t.float()
    return t


def matmul_precision(device: torch.device, precision: str):
    """The products of a step's float32 matmuls and convolutions. CUDA: TF32 (10-bit mantissas, float32
    accumulation) under precision=tf32, float32's under fp32. torch's own default lets cuDNN convolutions use TF32
    even in "fp32", and twopass/recompute's second backward would then round ~1e-3 away from the pass that measured
    the norms, so fp32 turns it off. The CPU: oneDNN's IEEE float32 whatever the precision (a user's
    torch.set_float32_matmul_precision("medium") would let oneDNN round float32 inputs to bf16, under the certified
    norms too; tf32 changes nothing there). The norms and clipped sums run inside with TF32 off whatever the setting
    (certify.exact_float32). CUDA bf16: TF32 off for the step's float32 operations too (autocast's bf16 products do
    not read the flag): a compiled step keeps no run-time switch (runner/methods/compiled.py), so a user's global
    TF32 would otherwise reach the certified norms of a compiled bf16 step (stop 35). Other devices: unchanged.
    runner/fp32_mode.py sets the flags and puts the user's back after."""
    if device.type == "cpu" and cpu_is_ieee():
        return _NOTHING  # the common case: a shared no-op (a generator context costs ~3 us a step)
    return float32_mode(device.type, tf32=precision == "tf32")
