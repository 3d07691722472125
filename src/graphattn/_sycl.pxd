# Declarations of native/sycl's C++ API (include/graphattn/sycl/sdpa_sycl.hpp).
from libc.stdint cimport int64_t
from libcpp cimport bool
from libcpp.string cimport string

from graphattn._cpu cimport DType, SdpaBackwardArgs, SdpaForwardArgs, Status


cdef extern from "graphattn/sycl/sdpa_sycl.hpp" namespace "graphattn::sycl_plugin":
    int kMaxHeadDim
    cpdef enum class MatrixKernels:
        Auto
        Force
        Off
    void set_matrix_kernels(MatrixKernels policy)
    MatrixKernels matrix_kernels()
    Status sdpa_forward(void* queue, const SdpaForwardArgs& args) nogil
    Status sdpa_backward(void* queue, const SdpaBackwardArgs& args) nogil
    string sdpa_forward_kernel(void* queue, const SdpaForwardArgs& args) nogil
    Status prebuild(void* queue, DType input_dtype, int head_dim_qk, int head_dim_v, bool backward,
                    double* seconds) nogil
    Status build_xmx_sources(void* queue, bool* has_kernel) nogil
    int64_t builds_done()
    double build_seconds_total()
