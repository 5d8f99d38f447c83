"""Who speaks for a run and who writes its files: the one place that decides, for the process it runs in.

One process, or rank 0 of several: it logs at INFO, prints the result and writes the run's folder. Any other rank
logs warnings and errors only (each line naming its rank) and writes nothing (Hydra's folder for it is a scratch
one). A run's last line (why it was refused or failed) is printed once: under `dprun distributed.nproc_per_node=N`
(runner/launch.py) every rank hands it to the launcher (a file in DPRUN_REPORT_DIR), which prints one line for
the job; under torchrun or srun each rank prints its own, naming itself.

    speaker = Speaker.here()
    speaker.main                  # True: print the result, write the files
    speaker.last_line("refused", "lr='abc' is not valid: ...")
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from runner.launcher_env import launched_rank, launched_world_size


REPORT_DIR = "DPRUN_REPORT_DIR"  # set by runner/launch.py for the ranks it starts


@dataclass(frozen=True)
class Speaker:
    rank: int = 0
    size: int = 1

    @classmethod
    def here(cls) -> "Speaker":
        """This process, as its launcher (torchrun, srun, submitit, dprun's own) started it; one process otherwise."""
        return cls(launched_rank(), launched_world_size())

    @property
    def main(self) -> bool:
        """Rank 0 (or the only process): prints the run's result and writes its files."""
        return self.rank == 0

    @property
    def prefix(self) -> str:
        return "dprun: " if self.size == 1 else f"dprun: rank {self.rank}: "

    def configure_logging(self) -> None:
        """Rank 0 at INFO; other ranks warnings and errors only, each line naming its rank."""
        logging.basicConfig(level=logging.INFO if self.main else logging.WARNING,
                            format="[dprun] %(message)s" if self.main else f"[dprun rank {self.rank}] %(message)s",
                            force=True)

    def last_line(self, kind: str, text: str) -> None:
        """The run's last line, once for the job. kind: refused | failed | stopped (another rank failed first) |
        interrupted (rank 0 alone says it: every rank got the same signal)."""
        report_dir = os.environ.get(REPORT_DIR)
        if self.size > 1 and report_dir:  # dprun's own launcher prints one line for all the ranks
            (Path(report_dir) / f"rank{self.rank}.json").write_text(json.dumps({"kind": kind, "text": text}))
        elif kind != "interrupted" or self.main:
            print(f"{self.prefix if kind != 'interrupted' else 'dprun: '}{text}", file=sys.stderr)


def read_reports(report_dir: str | Path) -> dict[int, dict[str, str]]:
    """The ranks' last lines, {rank: {"kind", "text"}} (runner/launch.py)."""
    reports = {}
    for path in Path(report_dir).glob("rank*.json"):
        try:
            reports[int(path.stem.removeprefix("rank"))] = json.loads(path.read_text())
        except (ValueError, OSError):  # a rank killed while writing it: no line of its own
            continue
    return reports
