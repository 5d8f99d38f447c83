"""Where datasets live by default, without importing the datasets (or torch): read by runner/paths.py's config
resolver (`${dprun_data_dir:}`) and runner/data/.
"""
from __future__ import annotations

import os


def default_data_dir() -> str:
    """Per-user cache: $DPRUN_DATA_DIR, else $XDG_CACHE_HOME/dprun, else ~/.cache/dprun."""
    if os.environ.get("DPRUN_DATA_DIR"):
        return os.environ["DPRUN_DATA_DIR"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dprun")
