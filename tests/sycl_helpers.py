"""Helpers for the tests marked sycl: a queue on the first SYCL device, or a clean skip."""
import pytest


def get_queue_or_skip():
    """A dpctl.SyclQueue on the first SYCL device (the OpenCL CPU device in CI); skips the test without one."""
    from graphattn import sycl_runtime

    sycl_runtime.configure_environment()  # before dpctl enumerates: makes the pip-installed OpenCL device visible
    dpctl = pytest.importorskip("dpctl")
    pytest.importorskip("dpnp")
    try:
        from graphattn import _sycl  # noqa: F401
    except ImportError as why:
        pytest.skip(f"the SYCL plugin is not built: {why}")
    devices = dpctl.get_devices()
    if not devices:
        pytest.skip("no SYCL device is visible")
    return dpctl.SyclQueue(devices[0])
