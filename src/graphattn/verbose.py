"""GRAPHATTN_VERBOSE=1: one line per partitioning decision and per kernel execution, on stderr."""
from __future__ import annotations

import os
import sys

# set_verbose's level; None: GRAPHATTN_VERBOSE's, read at each call (the environment may change after import).
_level: int | None = None


def set_verbose(level: int | None) -> None:
    """0: quiet; 1: one line per partitioning decision and per kernel execution on stderr (as GRAPHATTN_VERBOSE=1);
    None: GRAPHATTN_VERBOSE decides again."""
    global _level
    _level = None if level is None else int(level)


def level() -> int:
    if _level is not None:
        return _level
    text = os.environ.get("GRAPHATTN_VERBOSE", "")
    try:
        return int(text or 0)
    except ValueError:
        return 0


def enabled() -> bool:
    return level() > 0


def log(category: str, *fields) -> None:
    """Prints ``graphattn_verbose,<category>,<field>,...`` when verbose output is on."""
    if enabled():
        print(",".join(["graphattn_verbose", category, *(str(f) for f in fields)]), file=sys.stderr, flush=True)
