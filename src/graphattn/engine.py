"""Engine and Stream: where partitions run, and how to wait for them."""
from __future__ import annotations

from . import sycl_runtime

ENGINE_KINDS = ("cpu", "gpu", "sycl")


class Engine:
    """A device to compile for and run on.

    Engine("cpu"); Engine("gpu") (the index-th SYCL GPU); Engine("sycl",
    queue=q) or Engine(q) for a dpctl.SyclQueue q; Engine("sycl") alone takes
    the index-th SYCL device of any type (the OpenCL CPU device where there is
    no GPU).  SYCL engines need the sycl extra.
    """

    def __init__(self, kind="cpu", index: int = 0, *, queue=None):
        if sycl_runtime.is_queue(kind):
            kind, queue = "sycl", kind
        kind_name = str(kind).rsplit(".", 1)[-1]
        if kind_name not in ENGINE_KINDS:
            raise ValueError(f"engine kind {kind!r} is not available: use one of {ENGINE_KINDS} or a dpctl.SyclQueue")
        if kind_name == "cpu":
            if queue is not None:
                raise ValueError("the CPU engine takes no queue; use Engine('sycl', queue=q) for a SYCL queue")
            if index != 0:
                raise ValueError(f"engine index {index} does not exist: the CPU engine has index 0 only")
            self.queue = None
        else:
            self.queue = sycl_runtime.queue_for(kind_name, index, queue)
        self.kind = kind_name
        self.index = index

    @property
    def is_sycl(self) -> bool:
        return self.queue is not None

    def __repr__(self) -> str:
        if self.is_sycl:
            return f"Engine({self.kind!r}, device={self.queue.sycl_device.name!r})"
        return f"Engine({self.kind!r}, {self.index})"


class Stream:
    """An execution queue on an engine.  CPU execution is synchronous; on a SYCL engine execute submits to the
    engine's queue and wait() waits for it."""

    def __init__(self, engine: Engine):
        if not isinstance(engine, Engine):
            raise TypeError(f"Stream needs an Engine, got {type(engine).__name__}")
        self.engine = engine

    def wait(self) -> None:
        """Waits for the work submitted to this stream."""
        if self.engine.is_sycl:
            self.engine.queue.wait()
