"""torch's random state at a point of the step, replayed so that a forward run again draws the same dropout masks.

JL replays it for every chunk of directions; ReweightGP's `recompute` mode for its second forward. On CUDA the
device generator is saved too (dropout on a GPU draws from it)."""
from __future__ import annotations

import torch


def rng_state(device: torch.device):
    """torch's CPU RNG state (and the device's, on CUDA)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)
