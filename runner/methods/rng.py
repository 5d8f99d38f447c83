"""torch's random state at a point of the step, replayed so that a forward run again draws the same dropout masks.

JL replays it for every chunk of directions; ReweightGP's `recompute` mode for its second forward. On CUDA the
device generator is saved too (dropout on a GPU draws from it)."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(device: torch.device, host: bool = False):
    """torch's CPU RNG state (and the device's, on CUDA); with `host`, Python's `random` and numpy's global states too
    (the privacy check's: a forward drawing a coin from either, `if random.random() < 0.5: x = x.flip(-1)`, is
    replayed, where review 57's was taken for one it could not compare; not the step's: numpy's costs ~45 us)."""
    return (torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None),
            (random.getstate(), np.random.get_state()) if host else None)


def set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)
    if state[2] is not None:
        random.setstate(state[2][0])
        np.random.set_state(state[2][1])
