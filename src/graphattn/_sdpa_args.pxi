# Marshalling of graphattn::SdpaForwardArgs shared by the CPU and SYCL bindings (no math).

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
                               bint has_scale, bint scale_is_divisor, bint causal, bint inf_as_zero,
                               float dropout_p) except *:
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
    args.causal = causal
    args.inf_as_zero = inf_as_zero
    args.dropout_p = dropout_p
