"""Every entry point handles a user's mistake the way `dprun` does: ONE line naming the bad value (exit 2), never a
traceback; Ctrl-C is one line too (exit 130). A bug (any other exception) keeps its traceback.

    if __name__ == "__main__":
        sys.exit(run_entry(main, "python -m runner.signal_check"))   # main(argv) -> int (or anything: exit 0)

    p = OneLineParser(prog="dprun-report", ...)     # argparse, with a bad option as one line instead of a usage block
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from runner.errors import DprunError


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one DprunError line (argparse prints its usage block first and exits)."""

    def error(self, message: str):
        raise DprunError(f"{message} ({self.prog} --help lists the options)")


def run_entry(main: Callable[[list[str] | None], Any], prog: str, argv: list[str] | None = None) -> int:
    """main(argv)'s exit status, with bad input (DprunError, a config Hydra cannot compose) and Ctrl-C as one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        result = main(argv)
    except DprunError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as e:  # e.g. a key=value the config cannot take
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{prog}: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0
