# cython: language_level=3, boundscheck=False, wraparound=False
"""Bindings of native/sycl: argument marshalling only, no math.

A queue is a dpctl.SyclQueue; the C++ side receives the sycl::queue it wraps
(dpctl's queue reference).  Data are USM addresses.  Launches are
asynchronous on the queue.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp cimport bool

from graphattn._cpu cimport (BufferExtent, DType, MaskKind, RowAlignment, SdpaBackwardArgs, SdpaForwardArgs,
                            SequenceSpan, Status, TensorView, kNoKeyLimit)
from graphattn._sycl cimport (MatrixKernels, build_seconds_total, build_xmx_sources, builds_done, kMaxHeadDim,
                              matrix_kernels, prebuild, sdpa_backward, sdpa_forward, sdpa_forward_kernel,
                              set_matrix_kernels)

include "_sdpa_args.pxi"

MAX_HEAD_DIM = kMaxHeadDim
_MATRIX_KERNEL_MODES = {"auto": MatrixKernels.Auto, "force": MatrixKernels.Force, "off": MatrixKernels.Off}


def set_matrix_kernel_mode(str mode):
    """Set when forwards run the XMX kernel (see sdpa_sycl.hpp); returns the previous mode."""
    if mode not in _MATRIX_KERNEL_MODES:
        raise ValueError(f"matrix kernel mode must be one of {sorted(_MATRIX_KERNEL_MODES)}, got {mode!r}")
    previous = matrix_kernel_mode()
    set_matrix_kernels(_MATRIX_KERNEL_MODES[mode])
    return previous


def matrix_kernel_mode():
    cdef MatrixKernels current = matrix_kernels()
    return next(name for name, value in _MATRIX_KERNEL_MODES.items() if value == current)


cdef void* _queue_ref(object queue) except NULL:
    try:
        address = queue.addressof_ref()
    except AttributeError:
        raise TypeError(f"a SYCL call needs a dpctl.SyclQueue, got {type(queue).__name__}") from None
    return <void*><uintptr_t>address


cdef void _raise_if_failed(Status status) except *:
    if not status.ok:
        raise ValueError(status.message.decode())


cdef class ForwardPlan:
    """Compile-time half of a fused forward call on a queue (the CPU ForwardPlan's arguments, queue first)."""
    cdef SdpaForwardArgs args
    cdef object queue

    def __init__(self, queue, batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk, int64_t head_dim_v,
                 query, key, value, output, mask=None, stats=None, alibi_slopes=None, sinks=None, *,
                 int mask_kind=0, bint select_keep_value=True, bint has_scale=False, bint scale_is_divisor=False,
                 int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit, bint inf_as_zero=False,
                 float dropout_p=0.0, float softcap=0.0, int alignment=0):
        _queue_ref(queue)
        self.queue = queue
        _set_shape_and_flags(&self.args, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, mask_kind, select_keep_value,
                             has_scale, scale_is_divisor, window_left, window_right, inf_as_zero,
                             dropout_p, softcap, alignment)
        _set_forward_views(&self.args, query, key, value, output, mask, stats, alibi_slopes, sinks)

    def with_softcap(self, float softcap):
        """A copy of this plan with another softcap value (the graph API's comes with each call)."""
        cdef ForwardPlan plan = ForwardPlan.__new__(ForwardPlan)
        plan.args = _with_softcap(&self.args, softcap)
        plan.queue = self.queue
        return plan

    def kernel_name(self):
        """The kernel this plan runs on its device, with the reason when it is not the XMX one."""
        return sdpa_forward_kernel(_queue_ref(self.queue), self.args).decode()

    def run(self, uintptr_t query, uintptr_t key, uintptr_t value, uintptr_t output, uintptr_t mask=0,
            uintptr_t stats=0, float scale=1.0, int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit,
            float select_fill=float("-inf"), float window_fill=float("-inf"), uint64_t dropout_seed=0,
            uint64_t dropout_offset=0, extents=None, uintptr_t alibi_slopes=0, uintptr_t sinks=0):
        """Submit the kernel on the plan's queue for these USM addresses; raises ValueError on bad arguments.
        extents: None, or the (shape, element strides, itemsize) of the USM array at each address, in
        FORWARD_VIEWS' order (None for one not known): the views' reach is checked against them."""
        cdef SdpaForwardArgs local = self.args
        cdef Status status
        cdef void* q = _queue_ref(self.queue)
        _set_data_and_scalars(&local, query, key, value, output, mask, stats, scale, window_left, window_right,
                              select_fill, window_fill, dropout_seed, dropout_offset)
        local.alibi.slopes.data = <const void*>alibi_slopes
        local.sinks.data = <const void*>sinks
        cdef int i
        if extents is not None:
            for i in range(len(extents)):
                _set_extent(_forward_view(&local, i), extents[i])
        with nogil:
            status = sdpa_forward(q, local)
        _raise_if_failed(status)


def backward(queue, batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk, int64_t head_dim_v, dict views, *,
             int mask_kind=0, bint select_keep_value=True, bint has_scale=False, float scale=1.0,
             int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit, float select_fill=float("-inf"),
             float window_fill=float("-inf"), bint inf_as_zero=True, float dropout_p=0.0,
             uint64_t dropout_seed=0, uint64_t dropout_offset=0, dict extents=None, float softcap=0.0,
             int alignment=0):
    """Submit the fused backward kernels.  views maps the CPU backward's names to
    (dtype code, 5 strides, USM address); extents (optional) maps them to the (shape, element strides,
    itemsize) of the USM array at each address, which the views' reach is checked against."""
    cdef SdpaBackwardArgs args
    cdef Status status
    cdef void* q = _queue_ref(queue)
    _set_backward_args(&args, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, views, mask_kind, select_keep_value,
                       has_scale, scale, window_left, window_right, select_fill, window_fill, inf_as_zero, dropout_p,
                       dropout_seed, dropout_offset, softcap, alignment)
    for name, layout in (extents or {}).items():
        _set_extent(_backward_view(&args, name), layout)
    with nogil:
        status = sdpa_backward(q, args)
    _raise_if_failed(status)


def forward_packed(queue, dict views, spans, tuple batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk,
                   int64_t head_dim_v, *, float scale, int64_t window_left, int64_t window_right, str alignment,
                   float softcap=0.0, float dropout_p=0.0, uint64_t dropout_seed=0, uint64_t dropout_offset=0,
                   dict extents=None):
    """Submit a forward of packed sequences (graphattn/sequences.hpp).  views: operand name -> (dtype code,
    5 strides, USM address); spans: a C-contiguous int64 NumPy array (batch[0], 4) on the host, each row
    (query_begin, query_rows, key_begin, key_rows); extents as backward's."""
    if spans.dtype.str != "<i8" or spans.ndim != 2 or spans.shape[1] != 4 or not spans.flags.c_contiguous:
        raise ValueError("spans: a C-contiguous int64 array of shape (sequences, 4)")
    if spans.shape[0] != batch[0]:
        raise ValueError(f"spans: {spans.shape[0]} rows for {batch[0]} sequences")
    cdef SdpaForwardArgs args
    cdef Status status
    cdef void* q = _queue_ref(queue)
    _set_shape_and_flags(&args, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, <int>MaskKind.none, True, True,
                         False, window_left, window_right, True, dropout_p, softcap, False)
    for name, spec in views.items():
        _set_address_view(_forward_view(&args, FORWARD_VIEWS.index(name)), spec)
    for name, layout in (extents or {}).items():
        _set_extent(_forward_view(&args, FORWARD_VIEWS.index(name)), layout)
    args.scale = scale
    args.window.fill = float("-inf")
    args.dropout_seed = dropout_seed
    args.dropout_offset = dropout_offset
    args.alignment = <RowAlignment>(<int>ROW_ALIGNMENTS[alignment])
    args.sequences.spans = <const SequenceSpan*><uintptr_t>spans.ctypes.data
    with nogil:
        status = sdpa_forward(q, args)
    _raise_if_failed(status)


def build_kernels(queue, int dtype_code, int head_dim_qk, int head_dim_v, bint backward=False):
    """Build (or find in the process cache) the kernels for this input dtype code and these head sizes;
    returns the seconds it took."""
    cdef double seconds = 0.0
    cdef Status status
    cdef void* q = _queue_ref(queue)
    with nogil:
        status = prebuild(q, <DType>dtype_code, head_dim_qk, head_dim_v, backward, &seconds)
    _raise_if_failed(status)
    return seconds


def build_xmx(queue):
    """Build the XMX (joint_matrix) kernel sources for the queue's device; raises ValueError with the compiler's
    log if they do not compile.  Returns whether the device kept the kernel."""
    cdef bool has_kernel = False
    cdef Status status
    cdef void* q = _queue_ref(queue)
    with nogil:
        status = build_xmx_sources(q, &has_kernel)
    _raise_if_failed(status)
    return True if has_kernel else False


def build_stats():
    """(kernel builds done in this process, seconds they took)."""
    return builds_done(), build_seconds_total()
