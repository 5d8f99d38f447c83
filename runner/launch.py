"""`dprun distributed.nproc_per_node=N ...`: dprun starts N processes on this machine through torchrun's own launcher
(torch.distributed.run: the same elastic agent, rendezvous on a free local port), each running `dprun ...` as one
rank; a rank that fails ends the others (SIGTERM, then SIGKILL) and the launcher prints ONE line naming it.

    dprun distributed.nproc_per_node=2 method=reweight dataset=digits    # = torchrun --nproc_per_node=2 -m runner.cli ...

Several machines: torchrun --nnodes/--rdzv-endpoint, or Slurm (docs/distributed.md); this form is one machine only.
"""
from __future__ import annotations

import logging
import signal
import sys

from runner.errors import DprunError

KNOB = "distributed.nproc_per_node"


def requested(argv: list[str]) -> int:
    """N from `distributed.nproc_per_node=N` on the command line (1 when absent)."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key == KNOB:
            try:
                n = int(value)
            except ValueError:
                n = 0
            if n < 1:
                raise DprunError(f"{KNOB}={value} is not valid: {KNOB} must be an integer >= 1")
            return n
    return 1


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(argv: list[str], nproc: int) -> int:
    """Run `python -m runner.cli argv` as nproc ranks under torch.distributed's elastic agent; the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if {"-m", "--multirun"} & set(argv):
        raise DprunError(f"{KNOB} starts the processes of ONE run; for a sweep of distributed runs use a launcher "
                         f"with tasks (launcher=slurm hydra.launcher.tasks_per_node=N) or torchrun per run")
    for name in ("torch.distributed.elastic", "torch.distributed.run"):  # its INFO/WARNING chatter: the ranks'
        logging.getLogger(name).setLevel(logging.CRITICAL)  # own lines and the one line below say what happened
    args = parse_args([f"--nproc_per_node={nproc}", "--nnodes=1", "-m", "runner.cli", *argv])
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the root cause: the first rank that failed (by time)
        why = "its own line above says why" if failure.exitcode > 0 else "stopped from outside: no line of its own"
        print(f"dprun: distributed run failed: rank {rank} {exit_text(failure.exitcode)} ({why}); the other ranks "
              f"were stopped; the run's complete epochs are kept", file=sys.stderr)
        code = failure.exitcode
        return 128 - code if code < 0 else (code or 1)
    return 0
