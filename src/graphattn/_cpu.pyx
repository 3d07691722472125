# cython: language_level=3, boundscheck=False, wraparound=False
"""Bindings of native/cpu: argument marshalling only, no math.

A ForwardPlan holds everything a compiled partition knows at compile time
(shapes, strides, dtypes, flags); ``run`` fills in the data addresses and the
runtime scalars and calls the kernel with the GIL released.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp.vector cimport vector
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize

cimport numpy as cnp
import numpy as np

cnp.import_array()

from graphattn._cpu cimport (AccumulateArgs, BufferExtent, DType, MaskKind, MergeAttentionArgs, Pass, SdpaBackwardArgs, SdpaForwardArgs, Status,
                             TensorView, cpu_features_string, force_kernel, forced_kernel, kernel_candidate_count,
                             kernel_candidate_name, kernel_candidate_unavailable, set_scratch_poisoning, max_threads, sdpa_backward, sdpa_backward_isa, sdpa_backward_plan,
                             sdpa_dtype_class, sdpa_forward, sdpa_forward_isa, sdpa_forward_isa_for, sdpa_forward_plan,
                             merge_attention as c_merge_attention, accumulate as c_accumulate,
                             dtype_size, RowAlignment, SequenceSpan)


include "_sdpa_args.pxi"


# The strides of a kernel view (3 batch dims, row, column), the most dims an array of a length-free replay
# may have, and the most batch folds it re-checks.
cdef enum:
    kViewDims = 5
    kMaxArrayDims = 16
    kMaxFolds = 96
    kReplayedViews = 6  # FORWARD_VIEWS from query to stats, whose strides follow the lengths
    kBackwardViews = 14  # BACKWARD_VIEWS
    kBackwardReplayed = 11  # BACKWARD_REPLAYED
    kBackwardGiven = 7  # of them, those whose strides are the caller's arrays' (the gradients are dense)
    kBackwardGrads = 4  # the gradients of BACKWARD_REPLAYED: dQ, dK, dV, dMask

# The backward views whose strides follow the lengths: the caller's Q, K, V, O, stats, dO and mask, then the
# gradients the functional backward allocates dense in their grouped shapes.
BACKWARD_REPLAYED = ("query", "key", "value", "output", "stats", "grad_output", "mask", "grad_query", "grad_key",
                     "grad_value", "grad_mask")


cdef struct StrideSource:
    # A view stride: multiplier times the array's stride on axis; axis -1: stride 0 (broadcast).
    int axis
    int64_t multiplier


cdef void _set_source(StrideSource* source, object spec) except *:
    if spec is None:
        source.axis = -1
        source.multiplier = 0
        return
    axis, multiplier = spec
    if not 0 <= axis < kMaxArrayDims:
        raise ValueError(f"stride source axis {axis} outside the {kMaxArrayDims} dims an array may have")
    source.axis = axis
    source.multiplier = multiplier


cdef inline int64_t _source_stride(const StrideSource* source, const int64_t* strides) noexcept:
    return 0 if source.axis < 0 else strides[source.axis] * source.multiplier


cdef void _load_sources(StrideSource* into, bint* has_view, dict sources, tuple roles) except *:
    # The lowering's stride sources (role -> 5 sources) of each of roles, kViewDims per role in into.
    cdef int slot, i
    for slot in range(len(roles)):
        role_sources = sources.get(roles[slot])
        has_view[slot] = role_sources is not None
        for i in range(kViewDims):
            _set_source(&into[slot * kViewDims + i], None if role_sources is None else role_sources[i])


cdef struct FoldChecks:
    # The batch folds of a lowering that a length-free replay re-checks: the outer stride must stay the inner
    # one times size, both read from the strides of the array in slot.
    int count
    int slot[kMaxFolds]
    StrideSource outer[kMaxFolds]
    StrideSource inner[kMaxFolds]
    int64_t size[kMaxFolds]


cdef void _load_folds(FoldChecks* checks, tuple folds, tuple roles) except *:
    # folds: (role, outer source, inner source, inner size); those of roles other than the replayed ones (whose
    # strides do not follow the lengths) are left out.
    folds = tuple(fold for fold in folds if fold[0] in roles)
    if len(folds) > kMaxFolds:
        raise ValueError(f"more than {kMaxFolds} batch folds")
    checks.count = len(folds)
    cdef int i
    for i, (role, outer, inner, size) in enumerate(folds):
        checks.slot[i] = roles.index(role)
        _set_source(&checks.outer[i], outer)
        _set_source(&checks.inner[i], inner)
        checks.size[i] = size


cdef bint _folds_hold(const FoldChecks* checks, const int64_t* own) noexcept:
    # own: kMaxArrayDims strides per slot.
    cdef int i
    cdef const int64_t* strides
    for i in range(checks.count):
        strides = own + checks.slot[i] * kMaxArrayDims
        if _source_stride(&checks.outer[i], strides) != _source_stride(&checks.inner[i], strides) * checks.size[i]:
            return False
    return True


cdef int _load_strides(object strides, int64_t* into) except -1:
    # A tuple of element strides into a C array (None: no array, nothing loaded).
    if strides is None:
        return 0
    cdef int n = len(strides)
    if n > kMaxArrayDims:
        raise ValueError(f"arrays of more than {kMaxArrayDims} dims are not supported")
    cdef int i
    for i in range(n):
        into[i] = strides[i]
    return 0


cdef int _load_array_strides(object array, int64_t* into) except -1:
    # A NumPy array's element strides into a C array; 1 (nothing usable loaded) where a byte stride is not a
    # whole number of elements, which the full checks of a new plan then name.
    if not cnp.PyArray_Check(array):  # another array kind with NumPy's attributes
        return _load_byte_strides(array.strides, array.itemsize, into)
    cdef cnp.ndarray a = <cnp.ndarray>array
    cdef int n = cnp.PyArray_NDIM(a)
    if n > kMaxArrayDims:
        raise ValueError(f"arrays of more than {kMaxArrayDims} dims are not supported")
    cdef int64_t itemsize = cnp.PyArray_ITEMSIZE(a)
    cdef const cnp.npy_intp* strides = cnp.PyArray_STRIDES(a)
    cdef int i
    for i in range(n):
        if strides[i] % itemsize:
            return 1
        into[i] = strides[i] // itemsize
    return 0


cdef int _load_byte_strides(tuple strides, int64_t itemsize, int64_t* into) except -1:
    cdef int n = len(strides)
    if n > kMaxArrayDims:
        raise ValueError(f"arrays of more than {kMaxArrayDims} dims are not supported")
    cdef int i
    cdef int64_t stride
    for i in range(n):
        stride = strides[i]
        if stride % itemsize:
            return 1
        into[i] = stride // itemsize
    return 0


# A call's signature as one bytes object (signature_key), what the plan caches of the functional API and of
# dynamic graph partitions key NumPy calls on: bytes keep their hash, so a signature is hashed once however
# often the caches look it up, store and evict it, and it is built with no tuple per operand.
cdef enum:
    kKeyWords = 512
    kKeyFull = 1        # first word: a signature with every length and stride,
    kKeyLengthFree = 2  # or one with the sequence lengths (2 or more) and the strides left out
    kNoArray = -1       # an absent operand's word
    kLayoutArray = -2   # the first word of an operand given as a layout tuple (an array's first is its rank)
    kTagNone = 1        # each flag's first word: its type (the encoding stays one-to-one)
    kTagBool = 2
    kTagInt = 3
    kTagFloat = 4
    kTagStr = 5
    kTagTuple = 6

_MAX_PACKED_INT = (1 << 63) - 1
cdef int64_t kTooManyLengths = -(1 << 62)  # _key_dim's answer where a key would name more lengths than it holds


cdef struct KeyOptions:
    bint dtypes  # the key holds the arrays' dtypes
    bint naming  # a length is written -2 - its place among the distinct lengths met so far (else -1):
    int count    # those lengths, in order
    int64_t lengths[kMaxArrayDims]


cdef int64_t _key_dim(int64_t size, bint free, KeyOptions* options) noexcept:
    # A dim's word: its size, or for a free one (a length of 2 or more) -1, or, naming the lengths, -2 - its
    # place among the distinct lengths met so far; kTooManyLengths where no place is left.
    if not free:
        return size
    if not options.naming:
        return -1
    cdef int j = 0
    while j < options.count and options.lengths[j] != size:
        j += 1
    if j == options.count:
        if j == kMaxArrayDims:
            return kTooManyLengths
        options.lengths[j] = size
        options.count += 1
    return -2 - j


cdef int _pack_dims(int64_t* words, int at, int n, const int64_t* dims, const int64_t* strides, bint empty,
                    bint length_free, int rank, int64_t free_mask, KeyOptions* options) noexcept:
    # An operand's n dims at words[at:] (free ones as _key_dim writes them: length_free, bit b of free_mask
    # marking dim -1 - b where the operand has rank dims, rank 0: any), then in a full key its strides (an empty
    # operand's: a marker, its shape standing for them), in a length-free key which of its dims of 2 or more
    # have a stride of 0 or below; the next free index, or -1 where a length finds no place.  Lengths 0 and 1
    # stay in a length-free key: they change broadcasting and the checks.  So do broadcast (stride 0) and
    # reversed dims: a fresh call lowers them apart (copies, no fold), so a replay must not take them.
    cdef int i
    cdef int64_t signs = 0
    if length_free and n > kMaxArrayDims:
        return -1
    for i in range(n):
        words[at + i] = _key_dim(dims[i], length_free and (rank == 0 or rank == n) and
                                 (free_mask >> (n - 1 - i)) & 1 and dims[i] >= 2, options)
        if words[at + i] == kTooManyLengths:
            return -1
    at += n
    if length_free:
        for i in range(n):
            if dims[i] >= 2 and strides[i] <= 0:
                signs |= (<int64_t>1 << i) << (kMaxArrayDims if strides[i] < 0 else 0)
        words[at] = signs
        at += 1
    else:
        if empty:
            words[at] = -1
            at += 1
        else:
            for i in range(n):
                words[at + i] = strides[i]
            at += n
    return at


cdef int _pack_array(int64_t* words, int at, cnp.ndarray a, bint length_free, int rank, int64_t free_mask,
                     KeyOptions* options) except -2:
    # One operand's rank, dtype (where the key holds dtypes), dims and (full keys only) byte strides at
    # words[at:] (_pack_dims); the next free index, or -1 where it is not packed (too many dims or distinct
    # lengths) or a length-free key does not exist for it (an empty array).
    cdef int n = cnp.PyArray_NDIM(a)
    if at + 4 + 2 * n + 1 > kKeyWords:
        return -1
    cdef bint empty = cnp.PyArray_SIZE(a) == 0
    if length_free and empty:
        return -1
    words[at] = n
    if options.dtypes:
        words[at + 1] = cnp.PyArray_TYPE(a)
        words[at + 2] = cnp.PyArray_ISNOTSWAPPED(a)
        words[at + 3] = cnp.PyArray_ITEMSIZE(a)
        at += 3
    # npy_intp is int64_t on the 64-bit platforms this builds for
    return _pack_dims(words, at + 1, n, <const int64_t*>cnp.PyArray_DIMS(a), <const int64_t*>cnp.PyArray_STRIDES(a),
                      empty, length_free, rank, free_mask, options)


cdef int _pack_layout(int64_t* words, int at, tuple layout, bint length_free, int rank, int64_t free_mask,
                      KeyOptions* options) except -2:
    # _pack_array for an array described by (shape, element strides, dtype, on the CPU) (interop.torch_layout's
    # entries), its dtype by identity (torch's dtypes are singletons): the same words after a marker of its own.
    shape, strides, dtype, on_cpu = layout
    cdef Py_ssize_t n = len(shape)
    if n > kMaxArrayDims or at + 4 + 2 * n + 1 > kKeyWords:
        return -1
    cdef int64_t dims[kMaxArrayDims]
    cdef int64_t steps[kMaxArrayDims]
    cdef int i
    cdef bint empty = False
    for i in range(n):
        dims[i] = shape[i]
        empty = empty or dims[i] == 0
    if length_free and empty:
        return -1
    if not empty:
        if len(strides) != n:
            return -1
        for i in range(n):
            steps[i] = strides[i]
    words[at] = kLayoutArray
    words[at + 1] = n
    at += 2
    if options.dtypes:
        words[at] = <int64_t>id(dtype)
        words[at + 1] = on_cpu is True
        at += 2
    return _pack_dims(words, at, n, dims, steps, empty, length_free, rank, free_mask, options)


cdef int _pack_value(int64_t* words, int at, object value) except -2:
    # A flag (None, bool, int, float, str, or a tuple of them) at words[at:], type first; the next free index,
    # or -1 where it is not packed (another type, an int beyond 64 bits, no room left).
    if at + 2 > kKeyWords:
        return -1
    cdef double real
    cdef bytes text
    cdef Py_ssize_t n, i
    kind = type(value)
    if value is None:
        words[at] = kTagNone
        return at + 1
    if value is True or value is False:
        words[at] = kTagBool
        words[at + 1] = value
        return at + 2
    if kind is int:
        if not -_MAX_PACKED_INT <= value <= _MAX_PACKED_INT:
            return -1
        words[at] = kTagInt
        words[at + 1] = value
        return at + 2
    if kind is float:
        real = value
        words[at] = kTagFloat
        memcpy(&words[at + 1], &real, sizeof(double))
        return at + 2
    if kind is str:
        text = (<str>value).encode("utf-8", "surrogatepass")
        n = len(text)
        if at + 2 + (n + 7) // 8 > kKeyWords:
            return -1
        words[at] = kTagStr
        words[at + 1] = n
        words[at + 1 + (n + 7) // 8] = 0  # the last word's padding
        memcpy(&words[at + 2], <char*>text, n)
        return at + 2 + (n + 7) // 8
    if kind is tuple:
        n = len(<tuple>value)
        words[at] = kTagTuple
        words[at + 1] = n
        at += 2
        for i in range(n):
            at = _pack_value(words, at, (<tuple>value)[i])
            if at < 0:
                return -1
        return at
    return -1


def signature_key(arrays, tuple free_axes, tuple flags, bint length_free=False, bint name_lengths=False,
                  bint dtypes=True):
    """A call's signature as bytes: each of arrays' (a tuple or list) dims, dtype and byte strides (exactly
    np.ndarray, or None for an absent operand; or a layout (shape, element strides, dtype, on the CPU) as
    interop.torch_layout gives a torch tensor's), then flags (None, bools, ints, floats, strs and tuples of
    them).

    length_free: the same with the sequence lengths of 2 or more left out, and no strides, the key under which
    a plan is replayed for new lengths.  free_axes holds two ints per array, (rank, mask): bit b of mask marks
    dim -1 - b as a length where the array has rank dims (rank 0: any).  Such a dim is -1, or with name_lengths
    -2 - (the place of its size among the distinct sizes met so far), so that calls share the key only where
    their lengths are equal in the same places.  dtypes=False leaves the arrays' dtypes out.

    None where a call is not keyed so: another array type, a value of another type, too many dims, or
    (length_free) an empty operand; the caller then keys on a tuple."""
    cdef int64_t words[kKeyWords]
    words[0] = kKeyLengthFree if length_free else kKeyFull
    cdef int at = 1
    cdef KeyOptions options
    options.naming = name_lengths
    options.dtypes = dtypes
    options.count = 0
    cdef Py_ssize_t i
    for i in range(len(arrays)):
        a = arrays[i]
        if a is None:
            words[at] = kNoArray
            at += 1
            continue
        if type(a) is np.ndarray:
            if length_free:
                at = _pack_array(words, at, <cnp.ndarray>a, True, free_axes[2 * i], free_axes[2 * i + 1], &options)
            else:
                at = _pack_array(words, at, <cnp.ndarray>a, False, 0, 0, &options)
        elif type(a) is tuple and len(<tuple>a) == 4:
            if length_free:
                at = _pack_layout(words, at, <tuple>a, True, free_axes[2 * i], free_axes[2 * i + 1], &options)
            else:
                at = _pack_layout(words, at, <tuple>a, False, 0, 0, &options)
        else:
            return None
        if at < 0:
            return None
    at = _pack_value(words, at, flags)
    if at < 0:
        return None
    return PyBytes_FromStringAndSize(<char*>words, at * sizeof(int64_t))


cdef int _load_strides_of(object source, int64_t* into) except -1:
    # The element strides of source, a tuple of them or a NumPy array (None: nothing loaded); 1 as
    # _load_array_strides.
    if source is None or type(source) is tuple:
        return _load_strides(source, into)
    return _load_array_strides(source, into)


cdef double _no_elements[8]  # the address given for a torch tensor without storage


cdef uintptr_t _host_address(object array) except? 0:
    """The first element's address of a NumPy array or a torch CPU tensor.  An empty torch tensor may have
    no storage (address 0); the kernel touches none of its elements, so any valid address serves."""
    if cnp.PyArray_Check(array):
        return <uintptr_t>cnp.PyArray_DATA(<cnp.ndarray>array)
    cdef uintptr_t address = array.data_ptr()
    return address if address != 0 else <uintptr_t>&_no_elements[0]


cdef void _extent_of(object array, BufferExtent* extent):
    """The bytes a NumPy array's elements span around its first one (_span), so that the kernel's checks refuse
    views reaching past them.  Left unknown for a torch tensor: its layout is pinned by the caller's signature,
    and asking torch costs microseconds."""
    extent.begin = 0
    extent.end = -1
    if not cnp.PyArray_Check(array):
        return
    cdef cnp.ndarray a = <cnp.ndarray>array
    # npy_intp is int64_t on the 64-bit platforms this builds for
    _span(cnp.PyArray_NDIM(a), <const int64_t*>cnp.PyArray_DIMS(a), <const int64_t*>cnp.PyArray_STRIDES(a),
          cnp.PyArray_ITEMSIZE(a), extent)


cdef void _extents_of(object query, object key, object value, object output, object mask, object stats,
                      object alibi_slopes, object sinks, BufferExtent* extents):
    # In FORWARD_VIEWS' order.
    _extent_of(query, &extents[0])
    _extent_of(key, &extents[1])
    _extent_of(value, &extents[2])
    _extent_of(output, &extents[3])
    _extent_of(mask, &extents[4])
    _extent_of(stats, &extents[5])
    _extent_of(alibi_slopes, &extents[6])
    _extent_of(sinks, &extents[7])


cdef class ForwardPlan:
    """Compile-time half of a fused forward call."""
    cdef SdpaForwardArgs args

    def __init__(self, batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk, int64_t head_dim_v,
                 query, key, value, output, mask=None, stats=None, alibi_slopes=None, sinks=None, *,
                 int mask_kind=0, bint select_keep_value=True, bint has_scale=False, bint scale_is_divisor=False,
                 int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit, bint inf_as_zero=False,
                 float dropout_p=0.0, float softcap=0.0, int alignment=0):
        _set_shape_and_flags(&self.args, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, mask_kind, select_keep_value,
                             has_scale, scale_is_divisor, window_left, window_right, inf_as_zero,
                             dropout_p, softcap, alignment)
        _set_forward_views(&self.args, query, key, value, output, mask, stats, alibi_slopes, sinks)

    def with_softcap(self, float softcap):
        """A copy of this plan with another softcap value (the graph API's comes with each call)."""
        cdef ForwardPlan plan = ForwardPlan.__new__(ForwardPlan)
        plan.args = _with_softcap(&self.args, softcap)
        return plan

    def isa(self):
        """Name of the kernel build the run will use (for the verbose log)."""
        return sdpa_forward_isa_for(self.args).decode()

    def dispatch_text(self):
        """The kernel build, the rule that chose it and the run's work layout, as comma-separated key=value
        fields (for the verbose log)."""
        return sdpa_forward_plan(self.args).decode()

    def with_kv_quant(self, dict quant):
        """A copy of this plan whose key and/or value views read quantized bytes (graphattn/sdpa.hpp's KvQuant):
        quant maps "key"/"value" to (KvFormat code, group size, decoded dtype code, (scales' dtype code, 5
        strides), (zero points' dtype code, 5 strides) or None).  The scales' and zero points' arrays come with
        each run_arrays call (kv_params)."""
        cdef ForwardPlan plan = ForwardPlan.__new__(ForwardPlan)
        plan.args = self.args
        cdef TensorView* view
        for name, (code, group, decoded, scales, zero_points) in quant.items():
            view = _forward_view(&plan.args, FORWARD_VIEWS.index(name))
            view.dtype = DType.u8
            view.quant.format = <KvFormat>(<int>code)
            view.quant.group = group
            view.quant.decoded = <DType>(<int>decoded)
            _set_quant_layout(&view.quant.scales, scales)
            _set_quant_layout(&view.quant.zero_points, zero_points)
        return plan

    def run_arrays(self, query, key, value, output, mask=None, stats=None, float scale=1.0,
                   int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit, float select_fill=float("-inf"),
                   float window_fill=float("-inf"),
                   uint64_t dropout_seed=0, uint64_t dropout_offset=0, alibi_slopes=None, sinks=None,
                   kv_params=None):
        """As run, taking the arrays themselves: NumPy arrays, or torch CPU tensors (their first element's
        address is used; strides were fixed at plan time and are checked by the caller).  kv_params: a plan
        with_kv_quant's (key scales, key zero points, value scales, value zero points) arrays, None where a
        view has none."""
        cdef BufferExtent extents[8]
        cdef SdpaForwardArgs local
        _extents_of(query, key, value, output, mask, stats, alibi_slopes, sinks, extents)
        if kv_params is None:
            self._call(_host_address(query), _host_address(key), _host_address(value), _host_address(output),
                       _host_address(mask) if mask is not None else 0, _host_address(stats) if stats is not None else 0,
                       scale, window_left, window_right, select_fill, window_fill, dropout_seed, dropout_offset,
                       extents, _host_address(alibi_slopes) if alibi_slopes is not None else 0,
                       _host_address(sinks) if sinks is not None else 0)
            return
        local = self.args
        k_scales, k_zero_points, v_scales, v_zero_points = kv_params
        _set_quant_data(&local.key.quant.scales, k_scales)
        _set_quant_data(&local.key.quant.zero_points, k_zero_points)
        _set_quant_data(&local.value.quant.scales, v_scales)
        _set_quant_data(&local.value.quant.zero_points, v_zero_points)
        _run_forward(&local, _host_address(query), _host_address(key), _host_address(value), _host_address(output),
                     _host_address(mask) if mask is not None else 0, _host_address(stats) if stats is not None else 0,
                     scale, window_left, window_right, select_fill, window_fill, dropout_seed, dropout_offset,
                     extents, _host_address(alibi_slopes) if alibi_slopes is not None else 0,
                     _host_address(sinks) if sinks is not None else 0)

    def run(self, uintptr_t query, uintptr_t key, uintptr_t value, uintptr_t output, uintptr_t mask=0,
            uintptr_t stats=0, float scale=1.0, int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit,
            float select_fill=float("-inf"), float window_fill=float("-inf"), uint64_t dropout_seed=0,
            uint64_t dropout_offset=0, uintptr_t alibi_slopes=0, uintptr_t sinks=0):
        """Run the kernel on the given data addresses; raises ValueError on bad arguments."""
        self._call(query, key, value, output, mask, stats, scale, window_left, window_right, select_fill, window_fill,
                   dropout_seed, dropout_offset, NULL, alibi_slopes, sinks)

    def length_free(self, dict sources, tuple folds, tuple batch_steps):
        """A LengthFreeForward replaying this plan's layout for new sequence lengths.  sources and folds are the
        lowering's (attention_spec.KernelCall): role -> 5 sources, each (array axis, multiplier) or None, and
        (role, outer source, inner source, inner size) per batch fold; batch_steps are the output's batch
        strides over seq_q * head_dim_v (the stats': over seq_q), both dense."""
        cdef LengthFreeForward replay = LengthFreeForward.__new__(LengthFreeForward)
        replay.args = self.args
        cdef int i
        if len(batch_steps) > kMaxArrayDims - 2:
            raise ValueError(f"arrays of more than {kMaxArrayDims} dims are not supported")
        replay.batch_dims = len(batch_steps)
        for i in range(replay.batch_dims):
            replay.batch_steps[i] = batch_steps[i]
        # The per-index views (ALiBi slopes, sinks) keep their strides at any length: only the others replay.
        replayed = FORWARD_VIEWS[:kReplayedViews]
        _load_sources(&replay.sources[0][0], replay.has_view, sources, replayed)
        _load_folds(&replay.folds, folds, replayed)
        return replay

    def bound(self, int64_t window_left, int64_t window_right, float select_fill, float window_fill):
        """A BoundForward: run_arrays with these operands fixed, for repeated calls that only change data."""
        cdef BoundForward bound = BoundForward.__new__(BoundForward)
        bound.plan = self
        bound.window_left = window_left
        bound.window_right = window_right
        bound.select_fill = select_fill
        bound.window_fill = window_fill
        return bound

    cdef void _call(self, uintptr_t query, uintptr_t key, uintptr_t value, uintptr_t output, uintptr_t mask,
                    uintptr_t stats, float scale, int64_t window_left, int64_t window_right, float select_fill,
                    float window_fill,
                    uint64_t dropout_seed, uint64_t dropout_offset, const BufferExtent* extents,
                    uintptr_t alibi_slopes=0, uintptr_t sinks=0) except *:
        # extents: the buffers of FORWARD_VIEWS, or NULL (unknown)
        _run_forward(&self.args, query, key, value, output, mask, stats, scale, window_left, window_right,
                     select_fill, window_fill, dropout_seed, dropout_offset, extents, alibi_slopes, sinks)


cdef int _run_forward(const SdpaForwardArgs* args, uintptr_t query, uintptr_t key, uintptr_t value,
                      uintptr_t output, uintptr_t mask, uintptr_t stats, float scale, int64_t window_left,
                      int64_t window_right, float select_fill, float window_fill, uint64_t dropout_seed,
                      uint64_t dropout_offset, const BufferExtent* extents, uintptr_t alibi_slopes,
                      uintptr_t sinks) except -1:
    # The kernel on args with this call's data and scalars, the GIL released; extents: the buffers of
    # FORWARD_VIEWS, or NULL (unknown).  Raises ValueError on bad arguments.
    cdef SdpaForwardArgs local = args[0]
    cdef Status status
    _set_data_and_scalars(&local, query, key, value, output, mask, stats, scale, window_left, window_right,
                          select_fill, window_fill, dropout_seed, dropout_offset)
    local.alibi.slopes.data = <const void*>alibi_slopes
    local.sinks.data = <const void*>sinks
    cdef int i
    if extents != NULL:
        for i in range(8):
            _forward_view(&local, i).buffer = extents[i]
    with nogil:
        status = sdpa_forward(local)
    if not status.ok:
        raise ValueError(status.message.decode())
    return 0


cdef void _set_quant_layout(KvQuantParams* params, object spec) except *:
    # spec = (dtype code, five strides in elements), or None (no such values)
    if spec is None:
        return
    code, strides = spec
    params.dtype = <DType>(<int>code)
    for i in range(5):
        params.strides[i] = strides[i]


cdef void _set_quant_data(KvQuantParams* params, object array) except *:
    # The values' NumPy array or torch CPU tensor, or None (none: the data stays null)
    if array is None:
        return
    params.data = <const void*>_host_address(array)
    _extent_of(array, &params.buffer)


cdef void _set_quant_params(KvQuantParams* params, object spec) except *:
    # spec = (dtype code, five strides in elements, NumPy array or torch CPU tensor), or None (no such values)
    if spec is None:
        return
    code, strides, array = spec
    _set_quant_layout(params, (code, strides))
    _set_quant_data(params, array)


cdef void _set_quant(TensorView* view, object spec) except *:
    # spec = (KvFormat code, group size, decoded dtype code, scales spec, zero points spec or None)
    code, group, decoded, scales, zero_points = spec
    view.quant.format = <KvFormat>(<int>code)
    view.quant.group = group
    view.quant.decoded = <DType>(<int>decoded)
    _set_quant_params(&view.quant.scales, scales)
    _set_quant_params(&view.quant.zero_points, zero_points)


cdef void _set_pages(TensorView* view, cnp.ndarray table, int64_t block_rows, int64_t num_blocks) noexcept:
    view.pages.table = <const int32_t*>cnp.PyArray_DATA(table)
    view.pages.table_stride = table.shape[1]
    view.pages.block_rows = block_rows
    view.pages.num_blocks = num_blocks


def run_packed(dict views, cnp.ndarray spans, tuple batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk,
               int64_t head_dim_v, *, float scale, int64_t window_left, int64_t window_right, str alignment,
               float softcap=0.0, float dropout_p=0.0, uint64_t dropout_seed=0, uint64_t dropout_offset=0,
               bint backward=False, bint plan_only=False, cnp.ndarray block_table=None, int64_t block_rows=0,
               int64_t num_blocks=0, dict kv_quant=None):
    """One call of packed sequences (graphattn/sequences.hpp), forward or backward.  views: operand name of
    BACKWARD_VIEWS -> (dtype code, 5 strides, NumPy array or torch CPU tensor); spans: C-contiguous int64
    (batch[0], 4), each row (query_begin, query_rows, key_begin, key_rows); the window about the row before
    alignment.  block_table: a C-contiguous int32 (batch[0], max_blocks) table of a paged K/V cache (key and
    value strides[0] then step from block to block; graphattn/kv_rows.hpp), of num_blocks blocks of block_rows
    rows.  kv_quant: "key" and/or "value" -> (KvFormat code, group size, decoded dtype code, scales, zero points
    or None), scales and zero points as (dtype code, 5 strides, array) (graphattn/sdpa.hpp's KvQuant).
    plan_only: return the dispatch text instead of running.  Raises ValueError on bad arguments."""
    if spans.dtype != np.int64 or spans.ndim != 2 or spans.shape[1] != 4 or not spans.flags.c_contiguous:
        raise ValueError("spans: a C-contiguous int64 array of shape (sequences, 4)")
    if block_table is not None and (block_table.dtype != np.int32 or block_table.ndim != 2 or
                                    block_table.shape[0] != batch[0] or not block_table.flags.c_contiguous):
        raise ValueError("block_table: a C-contiguous int32 array of one row per sequence")
    if spans.shape[0] != batch[0]:
        raise ValueError(f"spans: {spans.shape[0]} rows for {batch[0]} sequences")
    cdef SdpaBackwardArgs args
    _set_shape_and_flags(&args.forward, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, <int>MaskKind.none, True,
                         True, False, window_left, window_right, True, dropout_p, softcap, False)
    cdef TensorView* view
    for name, (code, strides, array) in views.items():
        view = _backward_view(&args, name)
        _set_view(view, (code, strides))
        view.data = <const void*>_host_address(array)
        _extent_of(array, &view.buffer)
    args.forward.scale = scale
    args.forward.window.fill = float("-inf")
    args.forward.dropout_seed = dropout_seed
    args.forward.dropout_offset = dropout_offset
    args.forward.alignment = <RowAlignment>(<int>ROW_ALIGNMENTS[alignment])
    args.forward.sequences.spans = <const SequenceSpan*>cnp.PyArray_DATA(spans)
    if block_table is not None:
        _set_pages(&args.forward.key, block_table, block_rows, num_blocks)
        _set_pages(&args.forward.value, block_table, block_rows, num_blocks)
    if kv_quant is not None:
        for name, spec in kv_quant.items():
            _set_quant(_backward_view(&args, name), spec)
    if plan_only:
        return (sdpa_backward_plan(args) if backward else sdpa_forward_plan(args.forward)).decode()
    cdef Status status
    with nogil:
        if backward:
            status = sdpa_backward(args)
        else:
            status = sdpa_forward(args.forward)
    if not status.ok:
        raise ValueError(status.message.decode())


cpdef bint row_major(shape, strides) except -1:
    # Whether element strides lay shape out densely in row-major order, dims of size 1 taking any stride (torch's
    # is_contiguous, without a call into torch).
    cdef Py_ssize_t i
    cdef int64_t step = 1, size
    for i in range(len(shape) - 1, -1, -1):
        size = shape[i]
        if size != 1 and strides[i] != step:
            return False
        step *= size
    return True


cdef class LengthFreeForward:
    """A ForwardPlan's layout as its lowering (attention_spec.lower) made it, replayed for new sequence lengths:
    each view stride is a multiplier times one stride of the caller's array (the output and stats are dense),
    and where the lowering folded batch dims, the fold must still hold (the outer stride is the inner one times
    its size), else the replay declines and the caller lowers the call anew."""
    cdef SdpaForwardArgs args
    cdef bint has_view[kReplayedViews]
    cdef StrideSource sources[kReplayedViews][kViewDims]  # per view of FORWARD_VIEWS
    cdef int batch_dims
    cdef int64_t batch_steps[kMaxArrayDims]
    cdef FoldChecks folds
    cdef tuple out_head  # what call_numpy and call_layouts allocate (set_results)
    cdef object out_dtype
    cdef int out_type
    cdef bint with_stats

    def set_results(self, tuple out_head, out_dtype, bint stats):
        """What call_numpy and call_layouts return: an output of out_head + (seq_q, head_dim_v) in out_dtype (a
        NumPy dtype) and, with stats, f32 stats of out_head + (seq_q, 1)."""
        if len(out_head) + 2 > kMaxArrayDims:
            raise ValueError(f"arrays of more than {kMaxArrayDims} dims are not supported")
        self.out_head = out_head
        self.out_dtype = np.dtype(out_dtype)
        self.out_type = self.out_dtype.num
        self.with_stats = stats

    def call_layouts(self, tuple layouts, query, key, value, int64_t window_left, int64_t window_right,
                     float scale, int64_t dropout_seed, int64_t dropout_offset, empty_like, empty):
        """call_numpy for torch CPU tensors, their layouts as interop.torch_layout gives them: the results are
        empty_like(query) where the query has the output's shape and is contiguous, else empty(shape, NumPy
        dtype) (interop's torch_empty_like and torch_empty)."""
        q_layout, k_layout, v_layout = layouts
        q_shape, k_shape, v_shape = q_layout[0], k_layout[0], v_layout[0]
        if len(q_shape) < 2 or len(k_shape) < 2 or len(v_shape) < 2:
            return None
        cdef int64_t seq_q = q_shape[len(q_shape) - 2]
        cdef int64_t seq_kv = k_shape[len(k_shape) - 2]
        if v_shape[len(v_shape) - 2] != seq_kv:
            return None
        cdef SdpaForwardArgs args
        if self._replayed(&args, seq_q, seq_kv, q_layout[1], k_layout[1], v_layout[1], None, window_left,
                          window_right, None, None):
            return None
        out_shape = self.out_head + (seq_q, args.head_dim_v)
        output = empty_like(query) if q_shape == out_shape and row_major(q_shape, q_layout[1]) else \
            empty(out_shape, self.out_dtype)
        stats = empty(self.out_head + (seq_q, 1), np.float32) if self.with_stats else None
        cdef BufferExtent extents[8]  # unknown: torch's layouts are the key's
        _extents_of(query, key, value, output, None, stats, None, None, extents)
        _run_forward(&args, _host_address(query), _host_address(key), _host_address(value), _host_address(output), 0,
                     _host_address(stats) if stats is not None else 0, scale, window_left, window_right,
                     float("-inf"), float("-inf"), <uint64_t>dropout_seed, <uint64_t>dropout_offset, extents, 0, 0)
        return output if stats is None else (output, stats)

    def call_numpy(self, query, key, value, int64_t window_left, int64_t window_right, float scale,
                   int64_t dropout_seed, int64_t dropout_offset, alibi_slopes=None, sinks=None):
        """The call on NumPy query, key and value (no mask) at their own lengths, into new results as
        set_results says: the output, or (output, stats); None where K and V differ in length or a fold of the
        lowering no longer holds (nothing is run: the caller's full checks name the fault)."""
        cdef cnp.ndarray q = <cnp.ndarray?>query
        cdef cnp.ndarray k = <cnp.ndarray?>key
        cdef cnp.ndarray v = <cnp.ndarray?>value
        if cnp.PyArray_NDIM(q) < 2 or cnp.PyArray_NDIM(k) < 2 or cnp.PyArray_NDIM(v) < 2:
            return None
        cdef int64_t seq_q = cnp.PyArray_DIMS(q)[cnp.PyArray_NDIM(q) - 2]
        cdef int64_t seq_kv = cnp.PyArray_DIMS(k)[cnp.PyArray_NDIM(k) - 2]
        if cnp.PyArray_DIMS(v)[cnp.PyArray_NDIM(v) - 2] != seq_kv:
            return None
        cdef SdpaForwardArgs args
        if self._replayed(&args, seq_q, seq_kv, q, k, v, None, window_left, window_right, None, None):
            return None
        cdef cnp.npy_intp dims[kMaxArrayDims]
        cdef int n = len(self.out_head)
        cdef int i
        for i in range(n):
            dims[i] = self.out_head[i]
        dims[n] = seq_q
        dims[n + 1] = args.head_dim_v
        output = cnp.PyArray_EMPTY(n + 2, dims, self.out_type, 0)
        stats = None
        if self.with_stats:
            dims[n + 1] = 1
            stats = cnp.PyArray_EMPTY(n + 2, dims, cnp.NPY_FLOAT32, 0)
        cdef BufferExtent extents[8]
        _extents_of(q, k, v, output, None, stats, alibi_slopes, sinks, extents)
        _run_forward(&args, _host_address(q), _host_address(k), _host_address(v), _host_address(output), 0,
                     _host_address(stats) if stats is not None else 0, scale, window_left, window_right,
                     float("-inf"), float("-inf"), <uint64_t>dropout_seed, <uint64_t>dropout_offset, extents,
                     _host_address(alibi_slopes) if alibi_slopes is not None else 0,
                     _host_address(sinks) if sinks is not None else 0)
        return output if stats is None else (output, stats)

    def plan_for(self, int64_t seq_q, int64_t seq_kv, query, key, value, mask, int64_t window_left,
                 int64_t window_right, output=None, stats=None):
        """The ForwardPlan for these lengths, given query, key, value and mask (None without one) as their
        element strides (tuples) or as the NumPy arrays themselves, and the window about the row; None where a
        fold of the lowering no longer holds.  The output and the stats are dense unless given likewise (both,
        or the output alone where the call has no stats)."""
        cdef ForwardPlan plan = ForwardPlan.__new__(ForwardPlan)
        if self._replayed(&plan.args, seq_q, seq_kv, query, key, value, mask, window_left, window_right, output,
                          stats):
            return None
        return plan

    def run(self, int64_t seq_q, int64_t seq_kv, strides, int64_t window_left, int64_t window_right, query, key,
            value, output, mask, stats, float scale, int64_t dropout_seed, int64_t dropout_offset,
            alibi_slopes=None, sinks=None):
        """The kernel at these lengths through this replay, with no plan object: plan_for's arguments (strides:
        those of query, key, value and mask as plan_for takes them; dense output and stats), then the data
        (NumPy arrays or torch CPU tensors) and the scalars as BoundForward.run takes them.  False where a fold
        of the lowering no longer holds (nothing run), else True."""
        cdef SdpaForwardArgs args
        q_strides, k_strides, v_strides, mask_strides = strides
        if self._replayed(&args, seq_q, seq_kv, q_strides, k_strides, v_strides, mask_strides, window_left,
                          window_right, None, None):
            return False
        cdef BufferExtent extents[8]
        _extents_of(query, key, value, output, mask, stats, alibi_slopes, sinks, extents)
        _run_forward(&args, _host_address(query), _host_address(key), _host_address(value), _host_address(output),
                     _host_address(mask) if mask is not None else 0, _host_address(stats) if stats is not None else 0,
                     scale, window_left, window_right, float("-inf"), float("-inf"), <uint64_t>dropout_seed,
                     <uint64_t>dropout_offset, extents, _host_address(alibi_slopes) if alibi_slopes is not None else 0,
                     _host_address(sinks) if sinks is not None else 0)
        return True

    cdef int _replayed(self, SdpaForwardArgs* into, int64_t seq_q, int64_t seq_kv, query, key, value, mask,
                       int64_t window_left, int64_t window_right, output, stats) except -1:
        # plan_for's arguments into `into`: 0, or 1 where a fold no longer holds (into then half made).
        cdef int64_t own[kReplayedViews][kMaxArrayDims]  # strides of each array, by FORWARD_VIEWS index
        if _load_strides_of(query, own[0]) or _load_strides_of(key, own[1]) or _load_strides_of(value, own[2]) \
                or _load_strides_of(mask, own[4]):
            return 1
        cdef int i, view
        cdef int64_t head_dim_v = self.args.head_dim_v
        cdef int n = self.batch_dims
        if output is not None:
            if _load_strides_of(output, own[3]) or _load_strides_of(stats, own[5]):
                return 1
        else:
            for i in range(n):  # the output's and the stats' dense strides
                own[3][i] = self.batch_steps[i] * seq_q * head_dim_v
                own[5][i] = self.batch_steps[i] * seq_q
            own[3][n] = head_dim_v
            own[3][n + 1] = 1
            own[5][n] = 1
            own[5][n + 1] = 1
        if not _folds_hold(&self.folds, &own[0][0]):
            return 1
        into[0] = self.args
        into.seq_q = seq_q
        into.seq_kv = seq_kv
        into.window.left = window_left
        into.window.right = window_right
        cdef TensorView* target
        for view in range(kReplayedViews):
            if self.has_view[view]:
                target = _forward_view(into, view)
                for i in range(kViewDims):
                    target.strides[i] = _source_stride(&self.sources[view][i], own[view])
        return 0


cdef class BoundForward:
    """A ForwardPlan with the key window and fill values of its calls fixed (ForwardPlan.bound): the
    functional API's repeated calls reach the kernel through one call, with no Python frame between."""
    cdef readonly ForwardPlan plan
    cdef int64_t window_left, window_right
    cdef float select_fill, window_fill

    def run(self, query, key, value, output, mask, stats, float scale, int64_t dropout_seed,
            int64_t dropout_offset, alibi_slopes=None, sinks=None):
        """run_arrays with the fixed operands; dropout seed and offset are signed 64-bit values, passed on as
        their two's complement bits."""
        cdef BufferExtent extents[8]
        _extents_of(query, key, value, output, mask, stats, alibi_slopes, sinks, extents)
        self.plan._call(_host_address(query), _host_address(key), _host_address(value), _host_address(output),
                        _host_address(mask) if mask is not None else 0,
                        _host_address(stats) if stats is not None else 0, scale, self.window_left,
                        self.window_right, self.select_fill, self.window_fill, <uint64_t>dropout_seed,
                        <uint64_t>dropout_offset, extents, _host_address(alibi_slopes) if alibi_slopes is not None else 0,
                        _host_address(sinks) if sinks is not None else 0)


cdef class BackwardPlan:
    """Compile-time half of a fused backward call on the host: the kernel's arguments but the data and the
    per-call scalars."""
    cdef SdpaBackwardArgs args
    cdef bint present[kBackwardViews]  # the views of BACKWARD_VIEWS the call has

    def __init__(self, batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk, int64_t head_dim_v,
                 dict roles, *, int mask_kind=0, bint select_keep_value=True, bint has_scale=False,
                 int64_t window_left=kNoKeyLimit, int64_t window_right=kNoKeyLimit, bint inf_as_zero=True,
                 float dropout_p=0.0, float softcap=0.0, int alignment=0):
        # roles: operand name -> (dtype code, 5 strides)
        views = {name: (code, strides, 0) for name, (code, strides) in roles.items()}
        _set_backward_args(&self.args, batch, seq_q, seq_kv, head_dim_qk, head_dim_v, views, mask_kind,
                           select_keep_value, has_scale, 1.0, window_left, window_right, float("-inf"),
                           float("-inf"), inf_as_zero, dropout_p, 0, 0, softcap, alignment)
        cdef int i
        for i in range(kBackwardViews):
            self.present[i] = BACKWARD_VIEWS[i] in roles

    def dispatch_text(self):
        """isa=<build>,why=<the rule that chose it>, then the key pass's layout (for the verbose log)."""
        return sdpa_backward_plan(self.args).decode()

    def run(self, dict arrays, float scale, uint64_t dropout_seed, uint64_t dropout_offset,
            float select_fill=float("-inf"), float window_fill=float("-inf"), tuple window=None):
        """Run the kernel on arrays, operand name -> NumPy array or torch CPU tensor for each view of the
        plan (strides as planned; the kernel checks each view against its array's extent); window: this call's
        (left, right) about the row, where it is not the plan's (the graph API's come per call).  Raises
        ValueError on bad arguments."""
        cdef SdpaBackwardArgs local = self.args
        if window is not None:
            local.forward.window.left, local.forward.window.right = window
        cdef TensorView* view
        cdef Status status
        cdef int i
        for i in range(kBackwardViews):
            if self.present[i]:
                array = arrays[BACKWARD_VIEWS[i]]
                view = _backward_view_at(&local, i)
                view.data = <const void*>_host_address(array)
                _extent_of(array, &view.buffer)
        local.forward.scale = scale
        local.forward.select_fill = select_fill
        local.forward.window.fill = window_fill
        local.forward.dropout_seed = dropout_seed
        local.forward.dropout_offset = dropout_offset
        with nogil:
            status = sdpa_backward(local)
        if not status.ok:
            raise ValueError(status.message.decode())

    def length_free(self, dict sources, tuple folds, tuple grad_steps):
        """A LengthFreeBackward replaying this plan's layout for new sequence lengths.  sources and folds are
        the lowering's (see ForwardPlan.length_free), for the roles of BACKWARD_REPLAYED; grad_steps: for dQ,
        dK, dV and dMask (the last left out where the call has none), the dense strides of their batch dims
        over rows * cols."""
        cdef LengthFreeBackward replay = LengthFreeBackward.__new__(LengthFreeBackward)
        replay.template = self
        cdef int slot, i, g
        for slot in range(kBackwardReplayed):
            replay.view_index[slot] = BACKWARD_VIEWS.index(BACKWARD_REPLAYED[slot])
        _load_sources(&replay.sources[0][0], replay.has_view, sources, BACKWARD_REPLAYED)
        if not 3 <= len(grad_steps) <= kBackwardGrads:
            raise ValueError(f"grad_steps: 3 or {kBackwardGrads} gradients' strides, got {len(grad_steps)}")
        replay.grad_dims[3] = 0
        for g in range(len(grad_steps)):
            if len(grad_steps[g]) > kMaxArrayDims - 2:
                raise ValueError(f"arrays of more than {kMaxArrayDims} dims are not supported")
            replay.grad_dims[g] = len(grad_steps[g])
            for i in range(replay.grad_dims[g]):
                replay.grad_steps[g][i] = grad_steps[g][i]
        _load_folds(&replay.folds, folds, BACKWARD_REPLAYED)
        return replay


cdef class LengthFreeBackward:
    """A BackwardPlan's layout as its lowering made it, replayed for new sequence lengths (as LengthFreeForward
    does the forward's): the views of the caller's Q, K, V, O, stats and dO take their arrays' strides times
    the lowering's multipliers, the gradients' (dMask's included) are dense in their grouped shapes; a fold of
    batch dims that no longer holds declines."""
    cdef BackwardPlan template
    cdef int view_index[kBackwardReplayed]  # BACKWARD_VIEWS index of each BACKWARD_REPLAYED slot
    cdef bint has_view[kBackwardReplayed]
    cdef StrideSource sources[kBackwardReplayed][kViewDims]
    cdef int grad_dims[kBackwardGrads]
    cdef int64_t grad_steps[kBackwardGrads][kMaxArrayDims]
    cdef FoldChecks folds

    def plan_for(self, int64_t seq_q, int64_t seq_kv, query, key, value, output, stats, grad_output,
                 int64_t window_left, int64_t window_right, tuple grads=None, mask=None):
        """The BackwardPlan for these operands (NumPy arrays in their own shapes, of these lengths, or tuples of
        their element strides; mask None where the call has none) and the window about the row, or None where
        a fold of the lowering no longer holds for their strides.  grads: dQ, dK, dV and dMask (where the call
        has it) likewise, where they are not dense in their grouped shapes (the graph API's gradients are the
        caller's arrays)."""
        cdef int64_t own[kBackwardReplayed][kMaxArrayDims]  # strides of each slot's array
        cdef int slot_index = 0
        if grads is not None and len(grads) != kBackwardGrads - (not self.has_view[kBackwardReplayed - 1]):
            raise ValueError(f"grads: dQ, dK, dV{', dMask' if self.has_view[kBackwardReplayed - 1] else ''}'s "
                             f"strides, got {len(grads)}")
        for operand in (query, key, value, output, stats, grad_output, mask) + (grads or ()):
            if _load_strides_of(operand, own[slot_index]):
                return None
            slot_index += 1
        cdef SdpaForwardArgs* shape = &self.template.args.forward
        cdef int64_t rows[kBackwardGrads]
        cdef int64_t cols[kBackwardGrads]
        rows[0], rows[1], rows[2], rows[3] = seq_q, seq_kv, seq_kv, seq_q
        cols[0], cols[1], cols[2], cols[3] = shape.head_dim_qk, shape.head_dim_qk, shape.head_dim_v, seq_kv
        cdef int g, i, n, slot
        for g in range(kBackwardGrads if grads is None else 0):  # the gradients' dense strides
            n = self.grad_dims[g]
            for i in range(n):
                own[kBackwardGiven + g][i] = self.grad_steps[g][i] * rows[g] * cols[g]
            own[kBackwardGiven + g][n] = cols[g]
            own[kBackwardGiven + g][n + 1] = 1
        if not _folds_hold(&self.folds, &own[0][0]):
            return None
        cdef BackwardPlan plan = BackwardPlan.__new__(BackwardPlan)
        plan.args = self.template.args
        plan.present = self.template.present
        plan.args.forward.seq_q = seq_q
        plan.args.forward.seq_kv = seq_kv
        plan.args.forward.window.left = window_left
        plan.args.forward.window.right = window_right
        cdef TensorView* target
        for slot in range(kBackwardReplayed):
            if self.has_view[slot]:
                target = _backward_view_at(&plan.args, self.view_index[slot])
                for i in range(kViewDims):
                    target.strides[i] = _source_stride(&self.sources[slot][i], own[slot])
        return plan


cdef DType _part_dtype(part, int part_code, str what) except *:
    """The kernel dtype of a part array: part_code, which must name a float dtype of part's item size."""
    if part_code not in (<int>DType.f32, <int>DType.bf16, <int>DType.f16):
        raise ValueError(f"{what}: part_code {part_code} is not f32, bf16 or f16")
    if not isinstance(part, np.ndarray) or not part.flags.c_contiguous or part.itemsize != dtype_size(<DType>part_code):
        raise ValueError(f"{what}: the part must be a C-contiguous NumPy array of the dtype part_code names")
    return <DType>part_code


cdef int64_t _contiguous_tail(a):
    """How many values a's longest C-contiguous trailing block holds."""
    cdef int64_t length = 1
    for dim in range(a.ndim - 1, -1, -1):
        if a.shape[dim] != 1 and a.strides[dim] != a.itemsize * length:
            break
        length *= a.shape[dim]
    return length


cdef int64_t _run_stride(a, int64_t run_length, str what) except? -1:
    """The stride (in elements) from one run of run_length consecutive values of a (C order) to the next: a is
    contiguous, or its contiguous tail holds run_length values and the dims before it step over the runs by
    one steady stride.  Raises ValueError naming `what` otherwise."""
    cdef int64_t tail = _contiguous_tail(a)
    if a.size == 0 or tail == a.size:
        return run_length
    if tail != run_length or any(stride % a.itemsize for stride in a.strides):
        raise ValueError(f"{what}: strides {a.strides} do not hold runs of {run_length} contiguous values")
    cdef int dim = a.ndim - 1
    cdef int64_t length = 1, runs = 1, stride = 0
    while dim >= 0 and length < run_length:  # the tail's dims
        length *= a.shape[dim]
        dim -= 1
    while dim >= 0:
        if a.shape[dim] != 1:
            if runs == 1:
                stride = a.strides[dim] // a.itemsize
            elif a.strides[dim] != a.itemsize * stride * runs:
                raise ValueError(f"{what}: strides {a.strides} do not step over runs of {run_length} values by "
                                 "one stride")
            runs *= a.shape[dim]
        dim -= 1
    return stride


def merge_attention(out, stats, part_out, part_stats, int part_code=<int>DType.f32):
    """Merges a partial result (part_out, part_stats) of other keys into (out, stats), in place, by their
    log-sum-exp (sdpa.hpp's merge_attention): out (f32) and part_out (f32, bf16 or f16, as part_code says)
    (..., L, Dv), stats and part_stats (f32) (..., L, 1), of matching shapes.  out and stats may be views of
    some of the rows of longer arrays (each head's rows one run); the parts are C-contiguous."""
    for name, a in (("out", out), ("stats", stats), ("part_stats", part_stats)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise ValueError(f"merge_attention: {name} must be a float32 NumPy array")
    cdef DType part_dtype = _part_dtype(part_out, part_code, "merge_attention")
    if not part_stats.flags.c_contiguous:
        raise ValueError("merge_attention: part_stats must be C-contiguous")
    if part_out.shape != out.shape or stats.shape != part_stats.shape or out.ndim < 2 or \
            stats.shape != out.shape[:-1] + (1,):
        raise ValueError(f"merge_attention: shapes out {out.shape}, stats {stats.shape}, part_out "
                         f"{part_out.shape}, part_stats {part_stats.shape} do not match")
    if not out.flags.writeable or not stats.flags.writeable:
        raise ValueError("merge_attention: out and stats must be writeable")
    if out.size and _contiguous_tail(out) % out.shape[out.ndim - 1]:
        raise ValueError(f"merge_attention: out's rows must be contiguous, got strides {out.strides}")
    cdef MergeAttentionArgs args
    args.rows = stats.size
    args.head_dim_v = out.shape[out.ndim - 1]
    # a run: out's contiguous rows (all of them where out is contiguous)
    args.run_rows = _contiguous_tail(out) // args.head_dim_v if out.size else 0
    args.out_run_stride = _run_stride(out, args.run_rows * args.head_dim_v, "merge_attention: out")
    args.stats_run_stride = _run_stride(stats, args.run_rows, "merge_attention: stats")
    args.part_run_stride = args.run_rows * args.head_dim_v
    args.part_stats_run_stride = args.run_rows
    args.out = <float*>cnp.PyArray_DATA(<cnp.ndarray>out)
    args.stats = <float*>cnp.PyArray_DATA(<cnp.ndarray>stats)
    args.part_out = cnp.PyArray_DATA(<cnp.ndarray>part_out)
    args.part_dtype = part_dtype
    args.part_stats = <const float*>cnp.PyArray_DATA(<cnp.ndarray>part_stats)
    cdef Status status
    with nogil:
        status = c_merge_attention(args)
    if not status.ok:
        raise ValueError(status.message.decode())


def accumulate(total, part, int part_code=<int>DType.f32):
    """total += part, in place (sdpa.hpp's accumulate): total a writeable float32 array whose trailing dims
    hold runs of contiguous values and whose leading dims step over the runs by one stride (a NumPy view of
    rows of a contiguous array, for one), part a C-contiguous array of its shape, f32, bf16 or f16 as
    part_code says."""
    if not isinstance(total, np.ndarray) or total.dtype != np.float32 or not total.flags.writeable:
        raise ValueError("accumulate: total must be a writeable float32 NumPy array")
    cdef DType part_dtype = _part_dtype(part, part_code, "accumulate")
    if part.shape != total.shape:
        raise ValueError(f"accumulate: part {part.shape} and total {total.shape} differ in shape")
    cdef int64_t run_length = _contiguous_tail(total)
    cdef int64_t run_stride = _run_stride(total, run_length, "accumulate: total")
    cdef int64_t runs = total.size // run_length if total.size else 0
    cdef AccumulateArgs args
    args.runs = runs
    args.run_length = run_length
    args.sum = <float*>cnp.PyArray_DATA(<cnp.ndarray>total)
    args.sum_stride = run_stride
    args.part = cnp.PyArray_DATA(<cnp.ndarray>part)
    args.part_stride = run_length
    args.part_dtype = part_dtype
    cdef Status status
    with nogil:
        status = c_accumulate(args)
    if not status.ok:
        raise ValueError(status.message.decode())


def forward_isa(dtype="f32", seq_q=1 << 20, seq_kv=None, batch=1, causal=False, head_dim=64):
    """Name of the kernel build the forward kernel uses on this CPU for inputs of this dtype ("f32",
    "bf16" or "f16"), query length, key length (default: the query length), batch size (N * Hq) and
    head size, with or without the implicit causal mask and no other mask or dropout, e.g. "amx_bf16"
    or "avx512"."""
    if seq_kv is None:
        seq_kv = seq_q
    code = <DType>(<int>DTYPE_CODES[str(dtype)])
    return sdpa_forward_isa(code, seq_q, seq_kv, batch, causal, head_dim).decode()


cdef DType _backward_dtype_class(dtype) except *:
    """The dtype class of one dtype, or of a list of Q, K, V and dO's dtypes."""
    cdef DType codes[4]
    if isinstance(dtype, str) or not hasattr(dtype, "__iter__"):
        return <DType>(<int>DTYPE_CODES[str(dtype)])
    names = [str(d) for d in dtype]
    if not 1 <= len(names) <= 4:
        raise ValueError(f"backward_isa: expected 1 to 4 dtypes, got {len(names)}")
    for i, name in enumerate(names):
        codes[i] = <DType>(<int>DTYPE_CODES[name])
    return sdpa_dtype_class(codes, len(names))


def backward_isa(dtype="f32", seq_q=1 << 20, seq_kv=None):
    """Name of the kernel build the backward kernel uses for inputs of this dtype (or of these dtypes,
    Q, K, V and dO, given as a list), query length and key length (default: the query length), e.g.
    "amx_bf16" or "avx512"."""
    return sdpa_backward_isa(_backward_dtype_class(dtype), seq_q, seq_q if seq_kv is None else seq_kv).decode()


def backward_dispatch_text(batch, int64_t seq_q, int64_t seq_kv, int64_t head_dim_qk, int64_t head_dim_v,
                           dict roles, **options):
    """isa=<build>,why=<the rule that chose it>, then the key pass's layout, for a backward call with these
    arguments (BackwardPlan's), for the verbose log."""
    return BackwardPlan(batch, seq_q, seq_kv, head_dim_qk, head_dim_v, roles, **options).dispatch_text()


cdef Pass _pass_of(str name) except *:
    if name == "forward":
        return Pass.forward
    if name == "backward":
        return Pass.backward
    raise ValueError(f"pass must be 'forward' or 'backward', got {name!r}")


def kernel_candidates(str pass_name):
    """The pass's kernel candidates in the order they are tried: (name, why this CPU cannot run it or "")."""
    cdef Pass p = _pass_of(pass_name)
    return [(kernel_candidate_name(p, i).decode(), kernel_candidate_unavailable(p, i).decode())
            for i in range(kernel_candidate_count(p))]


def force(str pass_name, str name):
    """Forces the named candidate on the pass's later calls in this process ("" for the automatic choice);
    ValueError for an unknown name or one this CPU cannot run."""
    cdef Status status = force_kernel(_pass_of(pass_name), name.encode())
    if not status.ok:
        raise ValueError(status.message.decode())


def forced(str pass_name):
    """The pass's forced candidate, or "" when the choice is automatic."""
    return forced_kernel(_pass_of(pass_name)).decode()


def finite_scale_bound():
    """The largest magnitude of a finite scale the kernels take (graphattn/score_mods.hpp's kBase2Max)."""
    return float(kBase2Max)


def softcap_range():
    """(least, largest) softcap the kernels take besides 0 (graphattn/score_mods.hpp's kSoftcapMin, kSoftcapMax)."""
    return float(kSoftcapMin), float(kSoftcapMax)


def poison_scratch(bint on=True):
    """Testing aid: kernel scratch that is not cleared starts as NaN in every later call (see sdpa.hpp)."""
    set_scratch_poisoning(on)


def cpu_features():
    """ISA extensions detected on this CPU (and enabled by the OS)."""
    return cpu_features_string().decode().split()


def thread_count():
    """Number of OpenMP threads the kernels use."""
    return max_threads()


def first_shared_memory(tuple arrays, Py_ssize_t first_written):
    """(i, j): the first array i from index first_written on (one to be written) and another j whose elements'
    byte spans meet, or None.  The spans are the bounds np.may_share_memory checks by default, so arrays that
    interleave without a common element count too.  Objects other than NumPy arrays, and empty arrays, take
    no memory here."""
    cdef Py_ssize_t n = len(arrays), i, j
    cdef vector[int64_t] low = vector[int64_t](n, 0)
    cdef vector[int64_t] high = vector[int64_t](n, 0)
    cdef BufferExtent extent
    cdef cnp.ndarray a
    cdef int64_t base
    for i in range(n):
        if not cnp.PyArray_Check(arrays[i]):
            continue
        a = <cnp.ndarray>arrays[i]
        _span(cnp.PyArray_NDIM(a), <const int64_t*>cnp.PyArray_DIMS(a), <const int64_t*>cnp.PyArray_STRIDES(a),
              cnp.PyArray_ITEMSIZE(a), &extent)
        if extent.end > extent.begin:
            base = <int64_t><uintptr_t>cnp.PyArray_DATA(a)
            low[i], high[i] = base + extent.begin, base + extent.end
    for i in range(first_written, n):
        if low[i] == high[i]:
            continue
        for j in range(n):
            if j != i and low[j] != high[j] and low[i] < high[j] and low[j] < high[i]:
                return i, j
    return None


DTYPE_CODES = {"f32": <int>DType.f32, "bf16": <int>DType.bf16, "f16": <int>DType.f16,
               "boolean": <int>DType.boolean}
MASK_KIND_CODES = {"none": <int>MaskKind.none, "additive": <int>MaskKind.additive,
                   "select": <int>MaskKind.select}
