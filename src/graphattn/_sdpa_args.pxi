# Marshalling of graphattn::SdpaForwardArgs shared by the CPU and SYCL bindings (no math).
#
# A key window comes from Python as (left, right) about the aligned row (row_shift 0 and the RowAlignment
# code, which the kernel resolves at each call's lengths), kNoKeyLimit for a side without a limit, and its fill.

# The window side without a limit (graphattn::kNoKeyLimit).
NO_KEY_LIMIT = kNoKeyLimit

# How rows align to keys, by name (graphattn::RowAlignment): as_given takes the window about the row itself.
ROW_ALIGNMENTS = {"as_given": <int>RowAlignment.as_given, "top_left": <int>RowAlignment.top_left,
                  "bottom_right": <int>RowAlignment.bottom_right}

cdef void _set_view(TensorView* view, object spec) except *:
    # spec = (dtype code, five strides in elements)
    code, strides = spec
    view.dtype = <DType>(<int>code)
    if len(strides) != 5:
        raise ValueError("a tensor view needs 5 strides (3 batch, row, column)")
    for i in range(5):
        view.strides[i] = strides[i]


cdef void _set_shape_and_flags(SdpaForwardArgs* args, object batch, int64_t seq_q, int64_t seq_kv,
                               int64_t head_dim_qk, int64_t head_dim_v, int mask_kind, bint select_keep_value,
                               bint has_scale, bint scale_is_divisor, int64_t window_left, int64_t window_right,
                               bint inf_as_zero, float dropout_p, float softcap=0.0,
                               int alignment=0) except *:
    # The compile-time part of a call, shared by the forward plan and the backward.
    if len(batch) != 3:
        raise ValueError("batch must have 3 dimensions")
    for i in range(3):
        args.batch[i] = batch[i]
    args.seq_q = seq_q
    args.seq_kv = seq_kv
    args.head_dim_qk = head_dim_qk
    args.head_dim_v = head_dim_v
    args.mask_kind = <MaskKind>mask_kind
    args.select_keep_value = select_keep_value
    args.has_scale = has_scale
    args.scale_is_divisor = scale_is_divisor
    args.window.left = window_left
    args.window.right = window_right
    args.window.row_shift = 0
    args.inf_as_zero = inf_as_zero
    args.dropout_p = dropout_p
    args.softcap = softcap
    # The kernel aligns the rows for the window and ALiBi at the call's own lengths (RowAlignment).
    args.alignment = <RowAlignment>alignment
    args.alibi.bottom_right = False



cdef SdpaForwardArgs _with_softcap(const SdpaForwardArgs* args, float softcap) noexcept:
    # A plan's arguments with another softcap value (the graph API's comes with each call).
    cdef SdpaForwardArgs copy = args[0]
    copy.softcap = softcap
    return copy


cdef void _set_forward_views(SdpaForwardArgs* args, object query, object key, object value, object output,
                             object mask, object stats, object alibi_slopes=None, object sinks=None) except *:
    # The views of a forward plan (mask, stats, ALiBi slopes and sinks optional), in both bindings.
    _set_view(&args.query, query)
    _set_view(&args.key, key)
    _set_view(&args.value, value)
    _set_view(&args.output, output)
    if mask is not None:
        _set_view(&args.mask, mask)
    if stats is not None:
        _set_view(&args.stats, stats)
    if alibi_slopes is not None:
        _set_view(&args.alibi.slopes, alibi_slopes)
    if sinks is not None:
        _set_view(&args.sinks, sinks)


cdef void _set_data_and_scalars(SdpaForwardArgs* a, uintptr_t query, uintptr_t key, uintptr_t value,
                                uintptr_t output, uintptr_t mask, uintptr_t stats, float scale,
                                int64_t window_left, int64_t window_right, float select_fill, float window_fill,
                                uint64_t dropout_seed, uint64_t dropout_offset):
    # The run-time part of a forward call: data addresses and scalar operands.
    a.query.data = <const void*>query
    a.key.data = <const void*>key
    a.value.data = <const void*>value
    a.output.data = <const void*>output
    a.mask.data = <const void*>mask
    a.stats.data = <const void*>stats
    a.scale = scale
    a.window.left = window_left
    a.window.right = window_right
    a.select_fill = select_fill
    a.window.fill = window_fill
    a.dropout_seed = dropout_seed
    a.dropout_offset = dropout_offset


# The order of a forward call's views wherever they come as a sequence (the bindings' extents).
FORWARD_VIEWS = ("query", "key", "value", "output", "mask", "stats", "alibi_slopes", "sinks")


cdef TensorView* _forward_view(SdpaForwardArgs* args, int index) noexcept:
    # View `index` of FORWARD_VIEWS.
    if index == 0:
        return &args.query
    if index == 1:
        return &args.key
    if index == 2:
        return &args.value
    if index == 3:
        return &args.output
    if index == 4:
        return &args.mask
    if index == 5:
        return &args.stats
    if index == 6:
        return &args.alibi.slopes
    return &args.sinks


BACKWARD_VIEWS = FORWARD_VIEWS + ("grad_output", "grad_query", "grad_key", "grad_value", "grad_mask", "grad_sinks")


cdef TensorView* _backward_view_at(SdpaBackwardArgs* args, int index) noexcept:
    # View `index` of BACKWARD_VIEWS.
    if index < 8:
        return _forward_view(&args.forward, index)
    if index == 8:
        return &args.grad_output
    if index == 9:
        return &args.grad_query
    if index == 10:
        return &args.grad_key
    if index == 11:
        return &args.grad_value
    if index == 12:
        return &args.grad_mask
    return &args.grad_sinks


cdef TensorView* _backward_view(SdpaBackwardArgs* args, str name) except NULL:
    # The backward's view of this operand name (the functional backward's roles).
    if name not in BACKWARD_VIEWS:
        raise ValueError(f"backward: unknown operand {name!r}")
    return _backward_view_at(args, BACKWARD_VIEWS.index(name))


cdef void _set_address_view(TensorView* view, object spec) except *:
    # spec = (dtype code, five strides in elements, address of the view's origin)
    code, strides, address = spec
    _set_view(view, (code, strides))
    view.data = <const void*><uintptr_t>address


cdef void _set_backward_args(SdpaBackwardArgs* args, object batch, int64_t seq_q, int64_t seq_kv,
                             int64_t head_dim_qk, int64_t head_dim_v, dict views, int mask_kind,
                             bint select_keep_value, bint has_scale, float scale, int64_t window_left,
                             int64_t window_right, float select_fill, float window_fill, bint inf_as_zero,
                             float dropout_p, uint64_t dropout_seed, uint64_t dropout_offset, float softcap=0.0,
                             int alignment=0) except *:
    # views maps the backward's operand names to (dtype code, 5 strides, address).
    _set_shape_and_flags(&args.forward, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, mask_kind, select_keep_value,
                         has_scale, False, window_left, window_right, inf_as_zero, dropout_p, softcap,
                         alignment)
    for name, spec in views.items():  # a required view left out stays null, which the kernels' checks refuse
        _set_address_view(_backward_view(args, name), spec)
    args.forward.scale = scale
    args.forward.select_fill = select_fill
    args.forward.window.fill = window_fill
    args.forward.dropout_seed = dropout_seed
    args.forward.dropout_offset = dropout_offset


cdef void _span(int ndim, const int64_t* dims, const int64_t* byte_strides, int64_t itemsize,
                BufferExtent* extent) noexcept nogil:
    # The bytes an array's own elements span around its first one, [begin, end): the sum of its negative
    # steps stride * (dim - 1) below, of its positive ones above, plus one element; empty: nothing.
    cdef int i
    cdef int64_t step
    extent.begin = 0
    extent.end = itemsize
    for i in range(ndim):
        if dims[i] == 0:
            extent.end = 0
            return
        step = byte_strides[i] * (dims[i] - 1)
        if step < 0:
            extent.begin += step
        else:
            extent.end += step


cdef void _set_extent(TensorView* view, object layout) except *:
    # layout = (shape, element strides, itemsize) of the array a view reads or writes, or None (its buffer is
    # unknown and unchecked); the view's buffer becomes what the array spans.
    cdef int64_t dims[16]
    cdef int64_t byte_strides[16]
    cdef int i
    if layout is None:
        view.buffer.begin = 0
        view.buffer.end = -1
        return
    shape, strides, itemsize = layout
    if len(shape) > 16:
        raise ValueError("arrays of more than 16 dims are not supported")
    for i in range(len(shape)):
        dims[i] = shape[i]
        byte_strides[i] = strides[i] * itemsize
    _span(len(shape), dims, byte_strides, itemsize, &view.buffer)
