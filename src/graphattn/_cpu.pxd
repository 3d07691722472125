# Declarations of native/cpu's C++ API (include/graphattn/*.hpp).
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string


cdef extern from "graphattn/key_window.hpp" namespace "graphattn":
    int64_t kNoKeyLimit

    cpdef enum class RowAlignment(int32_t):
        as_given
        top_left
        bottom_right

    cdef struct KeyWindow:
        int64_t left
        int64_t right
        int64_t row_shift
        float fill


cdef extern from "graphattn/sequences.hpp" namespace "graphattn":
    cdef struct SequenceSpan:
        int64_t query_begin
        int64_t query_rows
        int64_t key_begin
        int64_t key_rows

    cdef struct PackedSequences:
        const SequenceSpan* spans


cdef extern from "graphattn/kv_format.hpp" namespace "graphattn":
    cpdef enum class KvFormat(int32_t):
        plain
        u8
        s8
        u4
        s4
        fp8_e4m3
        fp8_e5m2
        s4_in_byte


cdef extern from "graphattn/sdpa.hpp" namespace "graphattn":
    cpdef enum class DType(int32_t):
        f32
        bf16
        f16
        boolean
        u8

    cpdef enum class MaskKind(int32_t):
        none
        additive
        select

    cdef struct BufferExtent:
        int64_t begin
        int64_t end

    cdef struct KvPages:
        const int32_t* table
        int64_t table_stride
        int64_t block_rows
        int64_t num_blocks
        int64_t first_row
        int64_t cols

    cdef struct KvQuantParams:
        const void* data
        DType dtype
        int64_t strides[5]
        BufferExtent buffer

    cdef struct KvQuant:
        KvFormat format
        int64_t group
        DType decoded
        KvQuantParams scales
        KvQuantParams zero_points

    cdef struct TensorView:
        const void* data
        DType dtype
        int64_t strides[5]
        BufferExtent buffer
        KvPages pages
        KvQuant quant

    cdef struct Alibi:
        TensorView slopes
        bool bottom_right

    cdef struct SdpaForwardArgs:
        int64_t batch[3]
        int64_t seq_q
        int64_t seq_kv
        int64_t head_dim_qk
        int64_t head_dim_v
        TensorView query
        TensorView key
        TensorView value
        TensorView mask
        TensorView output
        TensorView stats
        bool has_scale
        bool scale_is_divisor
        float scale
        float softcap
        Alibi alibi
        TensorView sinks
        MaskKind mask_kind
        bool select_keep_value
        float select_fill
        KeyWindow window
        RowAlignment alignment
        PackedSequences sequences
        bool inf_as_zero
        float dropout_p
        uint64_t dropout_seed
        uint64_t dropout_offset
        uint64_t dropout_first_element

    cdef struct SdpaBackwardArgs:
        SdpaForwardArgs forward
        TensorView grad_output
        TensorView grad_query
        TensorView grad_key
        TensorView grad_value
        TensorView grad_mask
        TensorView grad_sinks

    cdef cppclass Status:
        bool ok
        string message

    cdef struct MergeAttentionArgs:
        int64_t rows
        int64_t head_dim_v
        int64_t run_rows
        float* out
        int64_t out_run_stride
        float* stats
        int64_t stats_run_stride
        const void* part_out
        int64_t part_run_stride
        DType part_dtype
        const float* part_stats
        int64_t part_stats_run_stride

    cdef struct AccumulateArgs:
        int64_t runs
        int64_t run_length
        float* sum
        int64_t sum_stride
        const void* part
        int64_t part_stride
        DType part_dtype

    Status merge_attention(const MergeAttentionArgs& args) nogil
    Status accumulate(const AccumulateArgs& args) nogil
    int64_t dtype_size(DType dt)

    Status sdpa_forward(const SdpaForwardArgs& args) nogil
    Status sdpa_backward(const SdpaBackwardArgs& args) nogil
    const char* sdpa_forward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv, int64_t batch, bint causal,
                                 int64_t head_dim)
    const char* sdpa_forward_isa_for(const SdpaForwardArgs& args)
    string sdpa_forward_plan(const SdpaForwardArgs& args)
    const char* sdpa_backward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv)
    string sdpa_backward_plan(const SdpaBackwardArgs& args)
    DType sdpa_dtype_class(const DType* dtypes, int count)
    void set_scratch_poisoning(bool on)


cdef extern from "graphattn/kernel_table.hpp" namespace "graphattn":
    cpdef enum class Pass(int32_t):
        forward
        backward

    int kernel_candidate_count(Pass p)
    const char* kernel_candidate_name(Pass p, int index)
    string kernel_candidate_unavailable(Pass p, int index)
    Status force_kernel(Pass p, const string& name)
    string forced_kernel(Pass p)


cdef extern from "graphattn/cpu_features.hpp" namespace "graphattn":
    string cpu_features_string()
    int max_threads()


cdef extern from "graphattn/score_mods.hpp" namespace "graphattn":
    const float kBase2Max
    const float kSoftcapMin
    const float kSoftcapMax
