"""Context-parallel attention across processes: ring attention over MPI (mpi4py).

Each rank holds a shard of the sequence (dim -2) of Q, K and V.  K and V travel around the ring, one hop per
step, in one buffer, while each rank attends its queries to the block it holds; the partial results merge by
their log-sum-exp in native code (graphattn._cpu.merge_attention).  The next hop's exchange runs on a
communication thread while the kernels run with the GIL released.  The backward sends each block's dK/dV
accumulators (f32) around with it; the last rank to add to them rounds them, once, and sends them home.
Two buffers per call take turns: the block in use is sent on while the next arrives in the other, so no hop
copies or packs.

Layouts: "contiguous" gives rank r chunk r of P; "zigzag" cuts the sequence into 2P chunks and gives rank r
chunks r and 2P-1-r, so that under a causal mask every rank has the same work.

    from mpi4py import MPI
    from graphattn import distributed as gd
    q_local = gd.shard(q, MPI.COMM_WORLD)                  # this rank's rows of a full (..., L, E) tensor
    out_local = gd.ring_attention(q_local, k_local, v_local, comm=MPI.COMM_WORLD, is_causal=True)
    out = gd.unshard(out_local, MPI.COMM_WORLD)            # the full result on every rank

Before any K/V moves, the ranks exchange what their calls must share (dtypes, shapes, options, the bytes that
travel): where one rank's arguments are bad or two ranks disagree, every rank raises the same ValueError.  Any
later error on a rank (KeyboardInterrupt and SystemExit included) prints it and aborts every rank of the
communicator (MPI_Abort): a ring never hangs, and no rank returns what a broken ring gave.
"""
from __future__ import annotations

import array
import os
import sys
import threading
import time

import numpy as np

from . import _cpu, arguments, dtypes, functional, functional_backward
from .interop import from_numpy, to_numpy

LAYOUTS = ("zigzag", "contiguous")


def _checked_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _chunk_count(size: int, layout: str) -> int:
    """The sequence's chunks: two per rank in the zigzag layout, one in the contiguous one."""
    return 2 * size if _checked_layout(layout) == "zigzag" else size


def chunks_of(rank: int, size: int, layout: str = "zigzag") -> tuple:
    """The global chunk indices rank `rank` holds, in the order its shard stacks them."""
    return (rank, 2 * size - 1 - rank) if _checked_layout(layout) == "zigzag" else (rank,)


def _chunk_length(seq_len: int, size: int, layout: str) -> int:
    count = _chunk_count(size, layout)
    if seq_len % count:
        raise ValueError(f"a sequence of {seq_len} rows does not cut into {count} equal chunks ({layout} layout "
                         f"over {size} ranks); pad it to a multiple of {count}")
    return seq_len // count


class _TorchGroup:
    """A torch.distributed process group (gloo) as the communicator the ring takes: rank, size, a paired send
    and receive, allgather of Python objects, and abort."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist = dist
        self.group = group if group is not None else dist.group.WORLD

    def Get_rank(self) -> int:
        return self.dist.get_rank(self.group)

    def Get_size(self) -> int:
        return self.dist.get_world_size(self.group)

    def Sendrecv(self, sendbuf, dest, recvbuf, source) -> None:
        import torch

        d = self.dist
        ops = [d.P2POp(d.isend, torch.from_numpy(sendbuf), d.get_global_rank(self.group, dest), self.group),
               d.P2POp(d.irecv, torch.from_numpy(recvbuf), d.get_global_rank(self.group, source), self.group)]
        for request in d.batch_isend_irecv(ops):
            request.wait()

    def allgather(self, value) -> list:
        gathered = [None] * self.Get_size()
        self.dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def Abort(self, code: int) -> None:
        # The peers' pending receives fail once this process's connections close, and they abort in turn.
        os._exit(code)


def _communicator(comm):
    """An mpi4py communicator as it is, or a torch.distributed process group wrapped as one."""
    if hasattr(comm, "Sendrecv") and hasattr(comm, "Get_rank"):
        return comm
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is not None and dist.is_available() and isinstance(comm, dist.ProcessGroup):
        return _TorchGroup(comm)
    raise TypeError(f"comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or a torch.distributed process "
                    f"group, got {type(comm).__name__}")


def _rank_size(comm) -> tuple[int, int]:
    return comm.Get_rank(), comm.Get_size()


def positions(seq_len: int, comm, layout: str = "zigzag") -> np.ndarray:
    """The global row indices of this rank's shard of a sequence of seq_len rows (for RoPE), in shard order."""
    rank, size = _rank_size(_communicator(comm))
    chunk = _chunk_length(seq_len, size, layout)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks_of(rank, size, layout)])


def shard(x, comm, layout: str = "zigzag"):
    """This rank's rows (sequence on dim -2) of a full tensor, as a contiguous copy of x's kind."""
    array, kind = to_numpy(x, "x")
    rows = positions(array.shape[-2], comm, layout)
    return from_numpy(np.ascontiguousarray(array[..., rows, :]), kind)


def unshard(x_local, comm, layout: str = "zigzag"):
    """The full tensor on every rank, gathered from each rank's shard (sequence on dim -2)."""
    array, kind = to_numpy(x_local, "x_local")
    comm = _communicator(comm)
    rank, size = _rank_size(comm)
    parts = comm.allgather(np.ascontiguousarray(array))
    per_rank = len(chunks_of(rank, size, layout))
    chunk = array.shape[-2] // per_rank
    full = np.empty(array.shape[:-2] + (chunk * _chunk_count(size, layout), array.shape[-1]), array.dtype)
    for r, part in enumerate(parts):
        for i, c in enumerate(chunks_of(r, size, layout)):
            full[..., c * chunk:(c + 1) * chunk, :] = part[..., i * chunk:(i + 1) * chunk, :]
    return from_numpy(full, kind)


class _Exchange:
    """One hop of the ring on a communication thread: send `outgoing` (bytes) to the next rank while receiving
    the previous rank's into `incoming`.  fill: (views of outgoing, arrays) copied into them first, on that
    thread, so that packing the first hop overlaps the first kernels (which read the arrays themselves).
    join() re-raises the thread's error."""

    def __init__(self, comm, outgoing: np.ndarray, incoming: np.ndarray, fill: tuple = ((), ())):
        rank, size = _rank_size(comm)
        self.error = None
        self.waited_for = threading.Event()  # set by join(): the caller has nothing left to overlap

        def run():
            try:
                for view, array in zip(*fill):
                    np.copyto(view, array)  # NumPy lets the GIL go for such copies
                _sendrecv(comm, outgoing, (rank + 1) % size, incoming, (rank - 1) % size, self.waited_for)
            except BaseException as why:  # handed to the main thread, which aborts the ring
                self.error = why

        self.thread = threading.Thread(target=run, name="graphattn-ring", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.waited_for.set()
        self.thread.join()
        if self.error is not None:
            raise self.error


# How long the communication thread sleeps between tests of a hop in flight while the kernels run.
_POLL_SECONDS = 1e-4


def _sendrecv(comm, outgoing, dest, incoming, source, waited_for: threading.Event) -> None:
    """comm.Sendrecv; where comm has non-blocking calls (mpi4py), a send and a receive tested in a loop that
    sleeps between tests until waited_for is set: a blocking MPI call spins on a core, which the kernels'
    threads need while the hop is in flight, but once the caller waits the hop should finish at full speed."""
    if not hasattr(comm, "Isend"):
        comm.Sendrecv(outgoing, dest=dest, recvbuf=incoming, source=source)
        return
    requests = [comm.Irecv(incoming, source=source), comm.Isend(outgoing, dest=dest)]
    test_all = type(requests[0]).Testall
    while not test_all(requests):
        if not waited_for.is_set():
            time.sleep(_POLL_SECONDS)


# How long an aborting rank waits for its error message to leave its stderr pipe.
_DRAIN_SECONDS = 2.0


def _wait_until_read(stream) -> None:
    """Returns once stream's pipe holds no unread bytes, or after _DRAIN_SECONDS: MPI_Abort kills the process
    manager that forwards a rank's output, and what it had not yet read from the pipe is lost."""
    try:
        import fcntl
        import termios
        fd = stream.fileno()
    except (ImportError, OSError, ValueError, AttributeError):
        return
    unread = array.array("i", [0])
    deadline = time.monotonic() + _DRAIN_SECONDS
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, unread)
        except OSError:  # not a pipe or a socket: nothing waits to be read
            return
        if unread[0] == 0:
            return
        time.sleep(1e-3)


def _abort_on_error(comm, what: str, fn):
    """fn(), or on any error (KeyboardInterrupt and SystemExit included) its message on stderr and MPI_Abort of
    every rank: a ring never hangs on a rank that left it, and no rank returns what a broken ring gave."""
    try:
        return fn()
    except BaseException as why:
        rank, size = _rank_size(comm)
        print(f"graphattn.distributed.{what}: rank {rank} of {size} failed: {type(why).__name__}: {why}; "
              "aborting every rank", file=sys.stderr, flush=True)
        _wait_until_read(sys.stderr)
        comm.Abort(1)
        raise


def _agreed(comm, what: str, local) -> None:
    """Checks that every rank makes the same call before any K/V moves: local() gives this rank's signature (a
    dict of what must match across ranks: dtypes, shapes, flags, message sizes) or raises for a bad argument.
    The signatures (or errors) are gathered once, so every rank raises the same ValueError, naming the ranks and
    what differs, where one rank failed or two disagree; none then waits on a peer that will not come."""
    def gather():
        try:
            mine = ("ok", local())
        except Exception as why:  # any other rank would wait in the gather for this one's signature
            mine = ("error", f"{type(why).__name__}: {why}")
        return comm.allgather(mine)

    size = comm.Get_size()
    gathered = _abort_on_error(comm, what, gather)  # an interrupt meanwhile, or a failed gather, ends every rank
    failed = [(r, text) for r, (state, text) in enumerate(gathered) if state == "error"]
    if failed:
        raise ValueError(f"graphattn.distributed.{what}: " + "; ".join(f"rank {r} of {size} failed: {text}"
                                                                         for r, text in failed))
    first = gathered[0][1]
    for r, (_, theirs) in enumerate(gathered[1:], start=1):
        differ = [key for key in first if first[key] != theirs.get(key)]
        if differ:
            detail = "; ".join(f"{key}: rank 0 has {first[key]!r}, rank {r} has {theirs.get(key)!r}" for key in differ)
            raise ValueError(f"graphattn.distributed.{what}: the ranks' calls disagree ({detail}); every rank must "
                             "pass shards of the same shapes and dtypes and the same options")


def _signature(arrays: dict, **options) -> dict:
    """What of a rank's call must match every other rank's: each array's dtype and shape, and the options."""
    signature = {f"{name} dtype": str(a.dtype) for name, a in arrays.items()}
    signature.update({f"{name} shape": tuple(a.shape) for name, a in arrays.items()})
    signature.update(options)
    return signature


def _unpack(buffer: np.ndarray, templates: list) -> list:
    """Views of buffer as arrays shaped and typed as the templates, in order."""
    views, offset = [], 0
    for t in templates:
        n = t.size * t.dtype.itemsize
        views.append(buffer[offset:offset + n].view(t.dtype).reshape(t.shape))
        offset += n
    return views


def _calls(rank: int, source: int, size: int, layout: str, is_causal: bool):
    """The kernel calls of one step: (first, count, keys, causal) for this rank's query chunks first .. first +
    count - 1 against the first `keys` chunks of the block of rank `source`, causal (bottom-right) or not.
    A block's chunks ascend, so a query chunk sees a prefix of them: all without a mask; under a causal mask
    the chunks before its own whole and its own causally.  Consecutive query chunks share a call where one
    mask serves them all: the same prefix and no diagonal, or, with diagonals, prefixes one chunk longer each
    (bottom-right alignment then puts each chunk's diagonal on its own key chunk).  A zigzag rank so makes one
    call per step, and no call of a diagonal alone."""
    mine, theirs = chunks_of(rank, size, layout), chunks_of(source, size, layout)
    group = None  # (first, count, keys, causal) being built
    for i, qc in enumerate(mine):
        seen = len(theirs) if not is_causal else sum(kc <= qc for kc in theirs)
        diagonal = is_causal and seen > 0 and theirs[seen - 1] == qc
        if group is not None and diagonal == group[3] and seen == group[2] + (1 if diagonal else 0):
            group = (group[0], group[1] + 1, seen, diagonal)
            continue
        if group is not None:
            yield group
        group = (i, 1, seen, diagonal) if seen else None
    if group is not None:
        yield group


def _rows(a: np.ndarray, index: int, chunk: int, count: int = 1) -> np.ndarray:
    """Chunks index .. index + count of a shard (rows on dim -2)."""
    return a[..., index * chunk:(index + count) * chunk, :]


def _local_inputs(q, k, v, comm, layout):
    qn, kind = to_numpy(q, "query")
    kn, _ = to_numpy(k, "key")
    vn, _ = to_numpy(v, "value")
    rank, size = _rank_size(comm)
    per_rank = len(chunks_of(rank, size, _checked_layout(layout)))
    for name, a in (("query", qn), ("key", kn), ("value", vn)):
        if a.ndim < 3 or a.shape[-2] % per_rank:
            raise ValueError(f"{name} shard {a.shape}: the sequence (dim -2) must hold {per_rank} equal chunks "
                             f"({layout} layout)")
    if not qn.shape[-2] == kn.shape[-2] == vn.shape[-2]:
        raise ValueError(f"query, key and value shards must hold the same rows, got {qn.shape}, {kn.shape}, "
                         f"{vn.shape}")
    return qn, kn, vn, kind, rank, size, qn.shape[-2] // per_rank


def ring_attention(q, k, v, *, comm, is_causal: bool = False, scale=None, enable_gqa: bool = False,
                   layout: str = "zigzag", return_stats: bool = False):
    """softmax(Q K^T * scale) V of the whole sequence for this rank's shard of queries: q, k and v are this
    rank's shards (sequence on dim -2, as shard() cuts them), comm an mpi4py communicator.  Returns the
    output shard (and its f32 log-sum-exp with return_stats), of q's kind and dtype.  comm may also be a
    torch.distributed process group; torch tensors that require grad get a result whose backward is
    ring_attention_backward."""
    comm = _communicator(comm)
    wants_grad = _wants_grad(q, k, v)
    _agreed(comm, "ring_attention", lambda: _call_signature(q, k, v, comm, layout, is_causal=bool(is_causal),
                                                            scale=_scale_text(scale), enable_gqa=bool(enable_gqa),
                                                            with_autograd=wants_grad))
    if wants_grad:
        return _torch_ring(q, k, v, comm, is_causal, scale, enable_gqa, layout, return_stats)
    return _abort_on_error(comm, "ring_attention", lambda: _ring_forward(q, k, v, comm, is_causal, scale,
                                                                          enable_gqa, layout, return_stats))


def _scale_text(scale) -> str:
    """A scale as the ranks compare it (repr: NaN equals NaN); a TypeError for what is no real number."""
    return "None" if scale is None else repr(arguments.real_number(scale, "scale"))


def _call_signature(q, k, v, comm, layout, extra: dict | None = None, **options) -> dict:
    """This rank's checked shards and options as _agreed compares them: the K/V bytes that travel included."""
    qn, kn, vn, *_ = _local_inputs(q, k, v, comm, layout)
    arrays = {"query": qn, "key": kn, "value": vn}
    arrays.update({name: to_numpy(a, name)[0] for name, a in (extra or {}).items()})
    return _signature(arrays, layout=layout, kv_bytes=kn.nbytes + vn.nbytes, **options)


def _wants_grad(*tensors) -> bool:
    if not any(getattr(t, "requires_grad", False) for t in tensors):
        return False
    import torch

    return torch.is_grad_enabled()


def _torch_ring(q, k, v, comm, is_causal, scale, enable_gqa, layout, return_stats):
    """ring_attention through a torch.autograd.Function whose backward is the ring backward."""
    import torch

    options = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, layout=layout)

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            out, stats = _abort_on_error(comm, "ring_attention", lambda: _ring_forward(
                query.detach(), key.detach(), value.detach(), comm, return_stats=True, **options))
            ctx.save_for_backward(query, key, value, out, stats)
            ctx.mark_non_differentiable(stats)
            return out, stats

        @staticmethod
        def backward(ctx, grad_out, _grad_stats):
            query, key, value, out, stats = ctx.saved_tensors
            return _abort_on_error(comm, "ring_attention_backward", lambda: _ring_backward(
                grad_out.contiguous(), query.detach(), key.detach(), value.detach(), out, stats, comm, **options))

    out, stats = RingAttention.apply(q, k, v)
    return (out, stats) if return_stats else out


def _ring_forward(q, k, v, comm, is_causal, scale, enable_gqa, layout, return_stats=False):
    qn, kn, vn, kind, rank, size, chunk = _local_inputs(q, k, v, comm, layout)
    out = stats = None  # the f32 result so far and its log-sum-exp (-inf: no key seen yet), made at the first call
    templates = [kn, vn]
    current = np.empty(kn.nbytes + vn.nbytes, np.uint8)  # the block in use, sent on meanwhile (bf16/f16 as bytes)
    spare = np.empty_like(current)  # where the next block arrives
    # Each step's results are merged (forward) or summed (backward) before the next step's calls write theirs, so
    # a ring call keeps its kernels' result arrays from step to step: fresh ones, tens of MB each, cost their
    # first touch on every step.
    parts = {}  # the result array of a call of `count` query chunks
    for step in range(size):
        source = (rank - step) % size  # the rank whose K/V block this rank holds now
        # The first step reads this rank's own K and V, which its hop packs meanwhile.
        fill = (_unpack(current, templates), templates) if step == 0 else ((), ())
        exchange = _Exchange(comm, current, spare, fill) if step < size - 1 else None
        k_block, v_block = templates if step == 0 else _unpack(current, templates)
        for first, count, keys, causal in _calls(rank, source, size, layout, is_causal):
            part, part_stats = functional.scaled_dot_product_attention(
                _rows(qn, first, chunk, count), _rows(k_block, 0, chunk, keys), _rows(v_block, 0, chunk, keys),
                is_causal=causal, scale=scale, enable_gqa=enable_gqa, return_stats=True,
                causal_alignment="bottom_right", out=parts.get(count))
            parts[count] = part
            if out is None:
                rows = qn.shape[-2]
                out = np.zeros(part.shape[:-2] + (rows, part.shape[-1]), np.float32)
                stats = np.full(part_stats.shape[:-2] + (rows, 1), -np.inf, np.float32)
            _cpu.merge_attention(_rows(out, first, chunk, count), _rows(stats, first, chunk, count),
                                 part, part_stats, dtypes.kernel_code(part.dtype))
        if exchange is not None:
            exchange.join()
            current, spare = spare, current
    if out is None:  # only a zero-size call sees no key at all
        raise ValueError("ring_attention: the queries saw no key")
    result = from_numpy(out.astype(qn.dtype, copy=False), kind)
    return (result, from_numpy(stats, kind)) if return_stats else result


def ring_attention_backward(grad_out, q, k, v, out, stats, *, comm, is_causal: bool = False, scale=None,
                            enable_gqa: bool = False, layout: str = "zigzag"):
    """(dq, dk, dv) of ring_attention for this rank's shards: out and stats are its output shard and f32
    log-sum-exp (return_stats=True).  Each K/V block travels with its dK/dV accumulators (f32), which return to
    their owner after a full turn and are rounded there once."""
    comm = _communicator(comm)
    _agreed(comm, "ring_attention_backward", lambda: _call_signature(
        q, k, v, comm, layout, {"grad_out": grad_out, "out": out, "stats": stats}, is_causal=bool(is_causal),
        scale=_scale_text(scale), enable_gqa=bool(enable_gqa)))
    return _abort_on_error(comm, "ring_attention_backward", lambda: _ring_backward(
        grad_out, q, k, v, out, stats, comm, is_causal, scale, enable_gqa, layout))


def _ring_backward(grad_out, q, k, v, out, stats, comm, is_causal, scale, enable_gqa, layout):
    qn, kn, vn, kind, rank, size, chunk = _local_inputs(q, k, v, comm, layout)
    do, _ = to_numpy(grad_out, "grad_out")
    on, _ = to_numpy(out, "out")
    st, _ = to_numpy(stats, "stats")
    dq = np.zeros(qn.shape, np.float32)
    # One message per hop, in one of two buffers laid out [K | V | dK | dV], dK and dV f32: at step t the buffer
    # in use holds this step's K/V block and the previous block's accumulators and is sent on; the other
    # receives the next block's K/V and this block's accumulators so far, to which this rank's parts are added
    # once it has arrived.  It is then the next step's buffer in use.
    kv_templates, sum_templates = [kn, vn], [np.empty(kn.shape, np.float32), np.empty(vn.shape, np.float32)]
    split = -(-(kn.nbytes + vn.nbytes) // 64) * 64  # [K | V] before, [dK | dV] after, 64-byte aligned
    current = np.empty(split + sum_templates[0].nbytes + sum_templates[1].nbytes, np.uint8)
    spare = np.empty_like(current)
    grad_parts = {}  # the gradient arrays of a step's call-th call (see _ring_forward's parts), by shape
    for step in range(size):
        source = (rank - step) % size
        send_kv, send_grads = step < size - 1, step > 0
        lo, hi = (0 if send_kv else split), (current.size if send_grads else split)
        # The first step reads this rank's own K and V, which its hop packs meanwhile (as the forward's).
        fill = (_unpack(current, kv_templates), kv_templates) if step == 0 else ((), ())
        exchange = _Exchange(comm, current[lo:hi], spare[lo:hi], fill) if hi > lo else None
        k_block, v_block = kv_templates if step == 0 else _unpack(current, kv_templates)
        parts = []  # (dk part, dv part, keys) of this step's calls, added to the accumulators once they arrive
        for call, (first, count, keys, causal) in enumerate(_calls(rank, source, size, layout, is_causal)):
            rows = dict(index=first, chunk=chunk, count=count)
            q_rows, k_rows, v_rows = _rows(qn, **rows), _rows(k_block, 0, chunk, keys), _rows(v_block, 0, chunk, keys)
            grads = functional_backward.scaled_dot_product_attention_backward(
                _rows(do, **rows), q_rows, k_rows, v_rows, _rows(on, **rows), _rows(st, **rows), is_causal=causal,
                scale=scale, enable_gqa=enable_gqa, causal_alignment="bottom_right",
                grads_out=grad_parts.get((call, q_rows.shape, k_rows.shape)))
            grad_parts[call, q_rows.shape, k_rows.shape] = grads
            _cpu.accumulate(_rows(dq, **rows), grads[0], dtypes.kernel_code(grads[0].dtype))
            parts.append((grads[1], grads[2], keys))
        if exchange is not None:
            exchange.join()
        dk_sum, dv_sum = _unpack(spare[split:], sum_templates)
        if step == 0:  # no rank has added to this rank's own block yet
            dk_sum.fill(0)
            dv_sum.fill(0)
        for dk_part, dv_part, keys in parts:
            _cpu.accumulate(_rows(dk_sum, 0, chunk, keys), dk_part, dtypes.kernel_code(dk_part.dtype))
            _cpu.accumulate(_rows(dv_sum, 0, chunk, keys), dv_part, dtypes.kernel_code(dv_part.dtype))
        current, spare = spare, current
    # Every rank has added to the block in use now: rounded once, it goes home to the next rank, its owner, in
    # the K/V bytes of the two buffers, which no step needs any more.
    dk_sum, dv_sum = _unpack(current[split:], sum_templates)
    for rounded, total in zip(_unpack(spare, kv_templates), (dk_sum, dv_sum)):
        np.copyto(rounded, total, casting="unsafe")
    if size > 1:
        _Exchange(comm, spare[:split], current[:split]).join()
        spare = current
    dk, dv = (a.copy() for a in _unpack(spare, kv_templates))
    return (from_numpy(dq.astype(qn.dtype, copy=False), kind), from_numpy(dk, kind), from_numpy(dv, kind))
