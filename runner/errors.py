"""The one error type users see: a single line naming the bad value and the accepted ones."""


class DprunError(Exception):
    """A user-facing error. The CLI prints `dprun: <message>` (one line) and exits with status 2."""


class RunComplete(Exception):
    """resume= of a run that already has the epochs asked for: nothing to train, nothing written (exit status 0)."""
