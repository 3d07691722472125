"""Which CPU kernel runs a call: the candidate tables of native/cpu/src/dispatch.cpp, seen from Python.

Each pass (forward, backward) tries its candidates in order and the first that accepts a call runs it::

    forward:  amx_bf16, amx_bf16x3, amx_bf16x6, avx512, avx2, portable
    backward: amx_bf16, amx_bf16x3, avx512, avx2, portable

`force_kernel` pins a candidate for the process (tests, timing one kernel against another); a forced
candidate runs calls that a speed rule gives to another, and a call it cannot run raises.
"""
from __future__ import annotations

from . import _cpu

PASSES = ("forward", "backward")
AUTOMATIC = "auto"


def kernel_candidates(pass_name: str = "forward") -> list[tuple[str, str]]:
    """The pass's candidates in the order they are tried: (name, why this CPU cannot run it, or "")."""
    return _cpu.kernel_candidates(pass_name)


def forced_kernels() -> dict[str, str]:
    """{pass: the forced candidate or "auto"}."""
    return {p: _cpu.forced(p) or AUTOMATIC for p in PASSES}


class force_kernel:
    """Forces kernel candidates for every later call in this process, or within a ``with`` block.

    ``force_kernel("avx2")`` forces the candidate of that name on each pass that has one; ``forward=`` and
    ``backward=`` set one pass each ("auto" restores the automatic choice, None leaves the pass as it is).
    ValueError names the pass and the candidates where a name is unknown or this CPU cannot run it.  Used as
    a context manager, it restores the previous setting on exit.  The setting is process-wide: calls on
    other threads see it too.
    """

    def __init__(self, name: str | None = None, *, forward: str | None = None, backward: str | None = None):
        if name is not None and (forward is not None or backward is not None):
            raise ValueError("force_kernel: give a name for both passes or forward=/backward=, not both")
        if name is not None:
            having = [p for p in PASSES if name == AUTOMATIC or name in dict(kernel_candidates(p))]
            if not having:
                raise ValueError(f"force_kernel: no pass has a kernel candidate {name!r}; forward: "
                                 f"{', '.join(n for n, _ in kernel_candidates('forward'))}; backward: "
                                 f"{', '.join(n for n, _ in kernel_candidates('backward'))}")
            forward, backward = (name if "forward" in having else None), (name if "backward" in having else None)
        wanted = {"forward": forward, "backward": backward}
        self._previous = forced_kernels()
        try:
            for p, value in wanted.items():
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise TypeError(f"force_kernel: {p} must be a candidate name or {AUTOMATIC!r}, got {value!r}")
                _cpu.force(p, "" if value == AUTOMATIC else value)
        except Exception:
            self._restore()
            raise

    def _restore(self) -> None:
        for p, value in self._previous.items():
            _cpu.force(p, "" if value == AUTOMATIC else value)

    def __enter__(self) -> "force_kernel":
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
