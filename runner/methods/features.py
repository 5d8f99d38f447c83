"""What `Method.configure` may ask of a method beyond one fp32 pass on one process: a typed capability, so that a
misspelt feature is an AttributeError where it is written, never a silent "supported".

    why = method.why_not(Feature.BF16)    # None: supported; else the one-line reason configure refuses it with
"""
from __future__ import annotations

from enum import Enum


class Feature(Enum):
    """The value is how the user asks for it (CLI key), in the refusal's message."""

    PHYSICAL_BATCH = "physical_batch_size"  # chunks of a logical batch (runner/methods/base.py chunks)
    BF16 = "precision=bf16"  # forward/backward under bfloat16 autocast (runner/precision.py)
    TF32 = "precision=tf32"  # forward/backward with TF32 products on CUDA (runner/precision.py matmul_precision)
    DISTRIBUTED = "distributed"  # several ranks, the clipped sums all-reduced (runner/distributed.py)

    def __str__(self) -> str:
        return self.value
