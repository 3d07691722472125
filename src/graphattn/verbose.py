"""GRAPHATTN_VERBOSE=1: one line per partitioning decision and per kernel execution, on stderr."""
from __future__ import annotations

import os
import sys

_level = int(os.environ.get("GRAPHATTN_VERBOSE", "0") or 0)


def set_verbose(level: int) -> None:
    """0: quiet; 1: one line per partitioning decision and per kernel execution on stderr (as GRAPHATTN_VERBOSE=1)."""
    global _level
    _level = int(level)


def enabled() -> bool:
    return _level > 0


def log(category: str, *fields) -> None:
    """Prints ``graphattn_verbose,<category>,<field>,...`` when verbose output is on."""
    if _level > 0:
        print(",".join(["graphattn_verbose", category, *(str(f) for f in fields)]), file=sys.stderr, flush=True)
