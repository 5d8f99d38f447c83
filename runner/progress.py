"""Progress bars (tqdm) that can be switched off (`progress=false`) without changing the loop.

Shown only on a terminal, so logs and CI output stay clean."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(iterable, *, enabled: bool = True, desc: str = "", leave: bool = False):
    return tqdm(iterable, desc=desc, leave=leave, disable=not enabled or not sys.stderr.isatty(), file=sys.stderr, dynamic_ncols=True)
