"""`dprun distributed.nproc_per_node=N ...`: dprun starts N processes on this machine through torchrun's own launcher
(torch.distributed.run: the same elastic agent, rendezvous on a free local port), each running `dprun ...` as one
rank; a rank that fails ends the others (SIGTERM, then SIGKILL) and the launcher prints ONE line for the job: the
ranks hand it their last lines (runner/speaker.py), so a bad value refused by every rank reads as one process's.

    dprun distributed.nproc_per_node=2 method=reweight dataset=digits    # = torchrun --nproc_per_node=2 -m runner.cli ...

Several machines: torchrun --nnodes/--rdzv-endpoint, or Slurm (docs/distributed.md); this form is one machine only.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

from runner.errors import DprunError
from runner.speaker import REPORT_DIR, read_reports

KNOB = "distributed.nproc_per_node"


def processes(argv: list[str]) -> int:
    """How many ranks to start: `distributed.nproc_per_node=N` on the command line; else, for resume=<dir>, as many
    as that run's own dprun started (its summary.json's distributed.nproc_per_node); else 1."""
    n = requested(argv)
    if n is not None:
        return n
    if not any(a.lstrip("+").startswith("resume=") for a in argv):
        return 1  # (no need to import runner.checkpoint, and dp-accounting with it, for every start)
    from runner.checkpoint import resume_folder, saved_summary

    run_dir = resume_folder(argv)
    if run_dir is None:
        return 1
    recorded = (saved_summary(run_dir)["config"].get("distributed") or {}).get("nproc_per_node")
    return int(recorded or 1)


def requested(argv: list[str]) -> int | None:
    """N from `distributed.nproc_per_node=N` on the command line (None when absent)."""
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
    return None


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(argv: list[str], nproc: int, new_dirs=()) -> int:
    """Run `python -m runner.cli argv` as nproc ranks under torch.distributed's elastic agent; the exit status.
    new_dirs: run folders that did not exist before this command; a job refused (exit status 2) leaves none of them
    behind when it holds only Hydra's record and dprun.log: rank 0 discards its own, but when another rank refused
    first the agent stops rank 0 before it can (a race seen under load), so the launcher makes sure."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if {"-m", "--multirun"} & set(argv):
        raise DprunError(f"{KNOB} starts the processes of ONE run; for a sweep of distributed runs use a launcher "
                         f"with tasks (launcher=slurm hydra.launcher.tasks_per_node=N) or torchrun per run")
    for name in ("torch.distributed.elastic", "torch.distributed.run"):  # its INFO/WARNING chatter: the ranks'
        logging.getLogger(name).setLevel(logging.CRITICAL)  # own lines and the one line below say what happened
    args = parse_args([f"--nproc_per_node={nproc}", "--nnodes=1", "-m", "runner.cli", *argv])
    with tempfile.TemporaryDirectory(prefix="dprun-launch-") as reports:
        os.environ[REPORT_DIR] = reports  # the ranks' last lines come here (runner/speaker.py)
        try:
            run(args)
        except ChildFailedError as e:
            line, code = failure_line(e, read_reports(reports))
            print(line, file=sys.stderr)
            if code == 2:  # refused before training: what a refused single process leaves, nothing
                from runner.run_dir import discard_unstarted

                for folder in new_dirs:
                    discard_unstarted(folder)
            return code
        except SignalException as e:  # Ctrl-C or SIGTERM to the launcher: the ranks were stopped; rank 0's line
            said = read_reports(reports).get(0, {})
            print(f"dprun: {said.get('text') or 'interrupted'}", file=sys.stderr)
            return 128 + int(e.sigval)
        finally:
            os.environ.pop(REPORT_DIR, None)
    return 0


def failure_line(error, reports: dict[int, dict[str, str]]) -> tuple[str, int]:
    """ONE line for a failed job, and its exit status. Every rank refused (a bad value) or failed (diverged) alike:
    that line, as one process prints it. Else the root cause: the first rank (by time) to fail with a line of its own (a rank that only
    saw another one stop is not a cause), and that the others were stopped."""
    first, failure = error.get_first_failure()
    texts = {r["text"] for r in reports.values()}
    if len(texts) == 1 and all(r["kind"] in ("refused", "failed") for r in reports.values()):  # alike: diverged too
        return f"dprun: {texts.pop()}", failure.exitcode if failure.exitcode > 0 else 1
    own = {r: rep for r, rep in reports.items() if rep["kind"] not in ("stopped", "interrupted")}
    # causes: a rank with a line of its own, or one killed before it could say anything (no line at all)
    causes = sorted(set(own) | {r for r in error.failures if r not in reports})
    rank = first if first in causes or not causes else causes[0]
    code = error.failures[rank].exitcode if rank in error.failures else 1
    if rank in own and own[rank]["kind"] == "refused":  # this rank alone refused (e.g. its device): its line
        return f"dprun: rank {rank}: {own[rank]['text']}", 2
    said = f": {own[rank]['text']}" if rank in own else \
        " (stopped from outside: no line of its own)" if code < 0 else " (no line of its own: see its output above)"
    return (f"dprun: distributed run failed: rank {rank} {exit_text(code)}{said}; the other ranks were stopped; the "
            f"run's complete epochs are kept"), 128 - code if code < 0 else (code or 1)
