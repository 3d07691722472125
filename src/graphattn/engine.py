"""Engine and Stream: where partitions run, and how to wait for them."""
from __future__ import annotations


class Engine:
    """A device to compile for and run on.  Only the CPU engine exists so far."""

    def __init__(self, kind: str = "cpu", index: int = 0):
        kind_name = str(kind).rsplit(".", 1)[-1]
        if kind_name != "cpu":
            raise ValueError(f"engine kind {kind!r} is not available: graphattn runs on 'cpu' "
                             "(the SYCL plugin is not built into this installation)")
        if index != 0:
            raise ValueError(f"engine index {index} does not exist: the CPU engine has index 0 only")
        self.kind = kind_name
        self.index = index

    def __repr__(self) -> str:
        return f"Engine({self.kind!r}, {self.index})"


class Stream:
    """An execution queue on an engine.  CPU execution is synchronous, so wait() returns at once."""

    def __init__(self, engine: Engine):
        if not isinstance(engine, Engine):
            raise TypeError(f"Stream needs an Engine, got {type(engine).__name__}")
        self.engine = engine

    def wait(self) -> None:
        """Waits for the work submitted to this stream (CPU execution is synchronous, so it returns at once)."""
        return None
