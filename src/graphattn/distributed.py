"""Context-parallel attention across processes: ring attention over MPI (mpi4py).

Each rank holds a shard of the sequence (dim -2) of Q, K and V.  K and V travel around the ring, one hop per
step, in one buffer, while each rank attends its queries to the block it holds; the partial results merge by
their log-sum-exp in native code (graphattn._cpu.merge_attention).  The next hop's exchange runs on a
communication thread while the kernels run with the GIL released.  The backward sends each block's dK/dV
accumulators (f32) around with it and rounds them once, on their owner.

Layouts: "contiguous" gives rank r chunk r of P; "zigzag" cuts the sequence into 2P chunks and gives rank r
chunks r and 2P-1-r, so that under a causal mask every rank has the same work.

    from mpi4py import MPI
    from graphattn import distributed as gd
    q_local = gd.shard(q, MPI.COMM_WORLD)                  # this rank's rows of a full (..., L, E) tensor
    out_local = gd.ring_attention(q_local, k_local, v_local, comm=MPI.COMM_WORLD, is_causal=True)
    out = gd.unshard(out_local, MPI.COMM_WORLD)            # the full result on every rank

An error on any rank prints it and aborts every rank of the communicator (MPI_Abort): a ring never hangs.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

from . import _cpu, functional, functional_backward
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
    the previous rank's into `incoming`.  join() re-raises the thread's error."""

    def __init__(self, comm, outgoing: np.ndarray, incoming: np.ndarray):
        rank, size = _rank_size(comm)
        self.error = None

        def run():
            try:
                comm.Sendrecv(outgoing, dest=(rank + 1) % size, recvbuf=incoming, source=(rank - 1) % size)
            except BaseException as why:  # handed to the main thread, which aborts the ring
                self.error = why

        self.thread = threading.Thread(target=run, name="graphattn-ring", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _abort_on_error(comm, what: str, fn):
    """fn(), or on any error its message on stderr and MPI_Abort of every rank (a ring never hangs on a rank
    that left it)."""
    try:
        return fn()
    except Exception as why:
        rank, size = _rank_size(comm)
        print(f"graphattn.distributed.{what}: rank {rank} of {size} failed: {type(why).__name__}: {why}; "
              "aborting every rank", file=sys.stderr, flush=True)
        comm.Abort(1)
        raise


def _pack(arrays: list) -> np.ndarray:
    """The arrays' bytes in one buffer (bf16/f16 travel as their bytes)."""
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])


def _unpack(buffer: np.ndarray, templates: list) -> list:
    """Views of buffer as arrays shaped and typed as the templates, in order."""
    views, offset = [], 0
    for t in templates:
        n = t.size * t.dtype.itemsize
        views.append(buffer[offset:offset + n].view(t.dtype).reshape(t.shape))
        offset += n
    return views


def _calls(rank: int, source: int, size: int, layout: str, is_causal: bool):
    """The kernel calls of one step: (i, keys, causal) for each of this rank's query chunks i that sees keys of
    the block of rank `source`, keys the block's first `keys` chunks.  A block's chunks ascend, so under a
    causal mask a query chunk sees a prefix of them: whole chunks before its own, then its own causally; the
    prefix goes in one call, causal bottom-right where it ends with the query's own chunk (row r then sees keys
    up to r plus the chunks before).  Without a mask every chunk is seen, in one call."""
    mine, theirs = chunks_of(rank, size, layout), chunks_of(source, size, layout)
    for i, qc in enumerate(mine):
        seen = len(theirs) if not is_causal else sum(kc <= qc for kc in theirs)
        if seen:
            yield i, seen, is_causal and theirs[seen - 1] == qc


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
    if _wants_grad(q, k, v):
        return _torch_ring(q, k, v, comm, is_causal, scale, enable_gqa, layout, return_stats)
    return _abort_on_error(comm, "ring_attention", lambda: _ring_forward(q, k, v, comm, is_causal, scale,
                                                                          enable_gqa, layout, return_stats))


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
    per_rank = qn.shape[-2] // chunk
    outs, stats = [None] * per_rank, [None] * per_rank  # per query chunk: the f32 result so far and its stats
    block = [np.ascontiguousarray(kn), np.ascontiguousarray(vn)]
    incoming = np.empty(sum(a.nbytes for a in block), np.uint8)
    for step in range(size):
        source = (rank - step) % size  # the rank whose K/V block this rank holds now
        exchange = _Exchange(comm, _pack(block), incoming) if step < size - 1 else None
        k_block, v_block = block
        for i, keys, causal in _calls(rank, source, size, layout, is_causal):
            part, part_stats = functional.scaled_dot_product_attention(
                _rows(qn, i, chunk), _rows(k_block, 0, chunk, keys), _rows(v_block, 0, chunk, keys),
                is_causal=causal, scale=scale, enable_gqa=enable_gqa, return_stats=True,
                causal_alignment="bottom_right")
            part = np.ascontiguousarray(part, np.float32)
            if outs[i] is None:
                outs[i], stats[i] = part, part_stats
            else:
                _cpu.merge_attention(outs[i], stats[i], part, part_stats)
        if exchange is not None:
            exchange.join()
            block = [np.array(a) for a in _unpack(incoming, block)]
    if any(o is None for o in outs):  # only a zero-size call sees no key at all
        raise ValueError("ring_attention: a query chunk saw no key")
    out, stats = np.concatenate(outs, axis=-2), np.concatenate(stats, axis=-2)
    result = from_numpy(out.astype(qn.dtype), kind)
    return (result, from_numpy(stats, kind)) if return_stats else result


def ring_attention_backward(grad_out, q, k, v, out, stats, *, comm, is_causal: bool = False, scale=None,
                            enable_gqa: bool = False, layout: str = "zigzag"):
    """(dq, dk, dv) of ring_attention for this rank's shards: out and stats are its output shard and f32
    log-sum-exp (return_stats=True).  Each K/V block travels with its dK/dV accumulators (f32), which return to
    their owner after a full turn and are rounded there once."""
    comm = _communicator(comm)
    return _abort_on_error(comm, "ring_attention_backward", lambda: _ring_backward(
        grad_out, q, k, v, out, stats, comm, is_causal, scale, enable_gqa, layout))


def _ring_backward(grad_out, q, k, v, out, stats, comm, is_causal, scale, enable_gqa, layout):
    qn, kn, vn, kind, rank, size, chunk = _local_inputs(q, k, v, comm, layout)
    do, _ = to_numpy(grad_out, "grad_out")
    on, _ = to_numpy(out, "out")
    st, _ = to_numpy(stats, "stats")
    dq = np.zeros(qn.shape, np.float32)
    kv = [np.ascontiguousarray(kn), np.ascontiguousarray(vn)]
    zeros = [np.zeros(kn.shape, np.float32), np.zeros(vn.shape, np.float32)]
    sent_grads = None  # the previous step's block's dK/dV accumulators, sent with this step's K/V
    for step in range(size):
        source = (rank - step) % size
        # One message per hop: this block's K/V for the next rank (unless it is the last step) and the previous
        # block's accumulators; in return the next block's K/V and this block's accumulators so far.
        outgoing = (kv if step < size - 1 else []) + (sent_grads or [])
        incoming_like = (kv if step < size - 1 else []) + (zeros if step > 0 else [])
        incoming = np.empty(sum(a.nbytes for a in incoming_like), np.uint8)
        exchange = _Exchange(comm, _pack(outgoing), incoming) if outgoing else None
        k_block, v_block = kv
        dk_block, dv_block = np.zeros(kn.shape, np.float32), np.zeros(vn.shape, np.float32)
        for i, keys, causal in _calls(rank, source, size, layout, is_causal):
            grads = functional_backward.scaled_dot_product_attention_backward(
                _rows(do, i, chunk), _rows(qn, i, chunk), _rows(k_block, 0, chunk, keys),
                _rows(v_block, 0, chunk, keys), _rows(on, i, chunk), _rows(st, i, chunk), is_causal=causal,
                scale=scale, enable_gqa=enable_gqa, causal_alignment="bottom_right")
            _rows(dq, i, chunk)[...] += grads[0]
            _rows(dk_block, 0, chunk, keys)[...] += grads[1]
            _rows(dv_block, 0, chunk, keys)[...] += grads[2]
        if exchange is not None:
            exchange.join()
            received = _unpack(incoming, incoming_like)
            if step > 0:  # what the ranks before added to this block
                dk_block += received[-2]
                dv_block += received[-1]
            if step < size - 1:
                kv = [np.array(a) for a in received[:2]]
        sent_grads = [dk_block, dv_block]
    if size > 1:  # the last block's accumulators go home: the next rank owns it
        incoming = np.empty(sum(a.nbytes for a in zeros), np.uint8)
        exchange = _Exchange(comm, _pack(sent_grads), incoming)
        exchange.join()
        sent_grads = _unpack(incoming, zeros)
    dk, dv = sent_grads
    return (from_numpy(dq.astype(qn.dtype), kind), from_numpy(dk.astype(kn.dtype), kind),
            from_numpy(dv.astype(vn.dtype), kind))
