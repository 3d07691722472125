"""What the SYCL plugin needs from the process: a visible device, dpctl queues and USM array facts.

Nothing here imports dpctl or the plugin, or changes the environment, until a SYCL engine, array or the plugin
is first asked for, so `import graphattn` stays cheap, works without the sycl extra and leaves os.environ as
it was.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

import numpy as np


_configured = False


def configure_environment() -> None:
    """Makes the pip-installed OpenCL CPU runtime visible and turns on the SYCL runtime's on-disk kernel cache,
    once, on the first use of SYCL (dpctl or the plugin), never at import.

    The intel-opencl-rt wheel's ICD file names a path that does not exist, so
    the OpenCL loader finds no device; pointing OCL_ICD_FILENAMES at the
    wheel's libintelocl.so fixes that.  It must run before anything
    enumerates SYCL devices: a program that imports dpctl itself first calls
    this.  On a CPU with AMX the OpenCL CPU compiler's target is capped at
    AVX-512 (see below).  A user's own settings win.
    """
    global _configured
    if _configured:
        return
    _configured = True
    os.environ.setdefault("SYCL_CACHE_PERSISTENT", "1")
    # The OpenCL CPU runtime's compiler aborts the whole process ("Cannot select: intrinsic
    # llvm.x86.tilezero.internal") wherever it lowers a kernel onto AMX tiles: the joint_matrix forward, and
    # the bf16 sub-group backward, whose loops its vectorizer maps there.  Its target capped at AVX-512 keeps
    # every kernel off the tiles (the CPU device then drops the joint_matrix kernel).
    # Binaries cached for one target are invalid for another (UR_RESULT_ERROR_INVALID_BINARY), and the cache's
    # key leaves the target out: the capped target's kernels are cached apart.
    if cpu_has_amx() and _CPU_TARGET_VARIABLE not in os.environ:
        os.environ[_CPU_TARGET_VARIABLE] = "skx"
        if "SYCL_CACHE_DIR" not in os.environ:
            cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            os.environ["SYCL_CACHE_DIR"] = os.path.join(cache, "libsycl_cache", "graphattn-opencl-cpu-skx")
    if "OCL_ICD_FILENAMES" in os.environ:
        return
    library = os.path.join(sys.prefix, "lib", "libintelocl.so")
    if not os.path.exists(library):
        return
    for icd in glob.glob(os.path.join(sys.prefix, "etc", "OpenCL", "vendors", "*.icd")):
        with open(icd) as f:
            named = f.read().strip()
        if named and os.path.exists(named):
            return  # the wheel's ICD file is usable as it is
    os.environ["OCL_ICD_FILENAMES"] = library


_CPU_TARGET_VARIABLE = "CL_CONFIG_CPU_TARGET_ARCH"


def cpu_has_amx() -> bool:
    from . import _cpu

    return "amx_bf16" in _cpu.cpu_features()


def opencl_cpu_targets_amx() -> bool:
    """Whether the OpenCL CPU device compiles for AMX tiles: the CPU has AMX-BF16 and nothing caps the
    runtime's target (configure_environment does, unless the user chose a target)."""
    return cpu_has_amx() and os.environ.get(_CPU_TARGET_VARIABLE, "") in ("", "sapphirerapids", "spr")


def plugin():
    """The compiled plugin module (graphattn._sycl); ImportError with the fix when it is missing."""
    configure_environment()
    try:
        from . import _sycl
    except ImportError as why:
        raise ImportError(f"the graphattn SYCL plugin cannot be loaded ({why}): {_PLUGIN_FIX}") from None
    return _sycl


_PLUGIN_FIX = "install graphattn with it: GRAPHATTN_SYCL=1 pip install 'graphattn[sycl]'"


def describe() -> str:
    """The SYCL plugin and its devices as they are here, or why there are none (`python -m graphattn info`)."""
    try:
        plugin()
    except ImportError as why:
        if importlib.util.find_spec("graphattn._sycl") is None:
            return f"sycl: the SYCL plugin is not part of this install; {_PLUGIN_FIX}"
        return f"sycl: {why}"
    try:
        dpctl = _dpctl()
    except ImportError as why:
        return f"sycl: plugin built; no devices listed: {why}"
    devices = dpctl.get_devices()
    if not devices:
        return "sycl: plugin built; dpctl sees no SYCL device"
    return "sycl devices: " + "; ".join(f"{d.filter_string} {d.name}" for d in devices)


def set_matrix_kernels(mode: str) -> str:
    """When SYCL forwards with bf16/f16 inputs run the XMX (joint_matrix) kernel: "auto" (devices with the
    ext_intel_matrix aspect, the default), "force" (any device whose compiler keeps the kernel, such as the
    OpenCL CPU device on a CPU with AMX) or "off".  Process-wide; returns the previous mode."""
    return plugin().set_matrix_kernel_mode(mode)


def _dpctl():
    configure_environment()
    try:
        import dpctl
    except ImportError:
        raise ImportError("SYCL engines need dpctl: pip install 'graphattn[sycl]'") from None
    return dpctl


def is_queue(x) -> bool:
    return type(x).__name__ == "SyclQueue" and type(x).__module__.split(".")[0] == "dpctl"


def queue_for(kind: str, index: int = 0, queue=None):
    """A dpctl.SyclQueue for Engine(kind): the given queue, or the index-th device of that kind."""
    dpctl = _dpctl()
    if queue is not None:
        if not is_queue(queue):
            raise TypeError(f"queue must be a dpctl.SyclQueue, got {type(queue).__name__}")
        return queue
    device_type = "gpu" if kind == "gpu" else None
    devices = dpctl.get_devices(device_type=device_type) if device_type else dpctl.get_devices()
    if not devices:
        what = "GPU" if kind == "gpu" else "SYCL"
        raise RuntimeError(f"no {what} device is visible to dpctl (dpctl.get_devices() lists "
                           f"{[d.name for d in dpctl.get_devices()]}); for tests on the CPU use Engine('sycl'), "
                           "which takes the OpenCL CPU device of intel-opencl-rt")
    if not 0 <= index < len(devices):
        raise ValueError(f"engine index {index} does not exist: there are {len(devices)} {kind} devices")
    return dpctl.SyclQueue(devices[index])


def is_usm_array(x) -> bool:
    # A NumPy array is answered first: probing it for the attribute costs an AttributeError.
    return type(x) is not np.ndarray and hasattr(x, "__sycl_usm_array_interface__")


def usm_address(array) -> int:
    """USM address of an array's first element (its offset included)."""
    info = array.__sycl_usm_array_interface__
    return info["data"][0] + info.get("offset", 0) * array.dtype.itemsize


def usm_layout(array) -> tuple[tuple, tuple, int]:
    """(shape, element strides, itemsize) of a USM array: what the plugin checks a kernel view's reach against
    (the bindings' _span)."""
    return tuple(array.shape), usm_element_strides(array), array.dtype.itemsize


def usm_element_strides(array) -> tuple[int, ...]:
    """Element strides of a USM array (None in the interface means C-contiguous)."""
    info = array.__sycl_usm_array_interface__
    if info.get("strides") is not None:
        return tuple(info["strides"])
    strides, step = [], 1
    for dim in reversed(info["shape"]):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def array_queue(array):
    return array.__sycl_usm_array_interface__["syclobj"]


def to_host(array, bf16: bool = False):
    """A NumPy copy of a USM array (waits for the queue's work on it); bf16 bit patterns come back as bfloat16."""
    import dpnp

    host = dpnp.asnumpy(array)
    if bf16 and host.dtype in ("uint16", "int16"):
        import ml_dtypes

        host = host.view(ml_dtypes.bfloat16)
    return host


def to_device(host, queue):
    """A dense dpnp copy of a NumPy array on the queue (bf16 as its bit patterns)."""
    import dpnp
    import numpy as np

    if str(host.dtype) == "bfloat16":
        host = host.view(np.uint16)
    return dpnp.asarray(np.ascontiguousarray(host), sycl_queue=queue)


def empty(shape, dtype, queue):
    """An uninitialised dpnp array on the queue (bf16 as uint16 bit patterns)."""
    import dpnp
    import numpy as np

    return dpnp.empty(shape, dtype=np.uint16 if str(dtype) == "bfloat16" else dtype, sycl_queue=queue)


def copy_from_host(destination, host) -> None:
    """Writes a NumPy array into a USM array of the same shape (bf16 as its bit patterns)."""
    import dpnp
    import numpy as np

    if str(host.dtype) == "bfloat16":
        host = host.view(np.uint16)
    destination[...] = dpnp.asarray(np.ascontiguousarray(host).astype(destination.dtype, copy=False),
                                    sycl_queue=array_queue(destination))


def wait_for_producers(arrays) -> None:
    """Waits for the work dpnp/dpctl have in flight on the queues of these USM arrays.

    dpnp orders its own operations through dpctl's SequentialOrderManager,
    not through the queue, so a kernel that reads its arrays must wait for
    those events first (a queue barrier alone does not cover them).
    """
    from dpctl.utils import SequentialOrderManager

    queues = {}
    for a in arrays:
        if is_usm_array(a):
            q = array_queue(a)
            queues[id(q)] = q
    for q in queues.values():
        SequentialOrderManager[q].wait()
