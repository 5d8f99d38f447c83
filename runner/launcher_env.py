"""What the launcher (torchrun, srun, submitit) says about this process, read from the environment alone: imported
by runner/speaker.py (who prints and writes) and runner/distributed.py (the process group) without importing torch.

    launched_world_size()   # WORLD_SIZE | SUBMITIT_LOCAL_NTASKS | SLURM_NTASKS, else 1
    launched_rank()         # RANK | SUBMITIT_LOCAL_GLOBALID | SLURM_PROCID, else 0
"""
from __future__ import annotations

import os


def launched_world_size() -> int:
    """The number of processes the launcher started (torchrun: WORLD_SIZE; srun: SLURM_NTASKS; submitit: its
    task count), read from the environment without starting anything."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    if os.environ.get("SUBMITIT_EXECUTOR") == "local":
        return int(os.environ.get("SUBMITIT_LOCAL_NTASKS", "1"))
    if os.environ.get("SLURM_PROCID") is not None and os.environ.get("SLURM_NTASKS"):
        return int(os.environ["SLURM_NTASKS"])
    return 1


def launched_rank() -> int:
    for key in ("RANK", "SUBMITIT_LOCAL_GLOBALID", "SLURM_PROCID"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 0
