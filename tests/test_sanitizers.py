"""The kernels and bindings built with AddressSanitizer and UndefinedBehaviorSanitizer run a sample of the suite
(forward, backward, graph API, robustness, fuzzing, SYCL on the OpenCL CPU device) and report nothing.

The build (CMake option GRAPHATTN_SANITIZE=address,undefined, about five minutes on two cores) goes to a
folder of its own, and the sample runs in a child pytest that imports it, with the sanitizer runtime preloaded
into Python.  Any report fails the run: -fno-sanitize-recover makes UBSan abort, and ASan aborts on its first
error.  By hand:

    pip install --no-build-isolation --no-deps -C cmake.define.GRAPHATTN_SANITIZE=address,undefined \\
        -C build-dir=build/sanitize --target /tmp/graphattn-asan .
    PYTHONPATH=/tmp/graphattn-asan LD_PRELOAD="$(g++ -print-file-name=libasan.so)" \\
        ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0 \\
        LD_LIBRARY_PATH="$(python -c 'import sys; print(sys.prefix)')/lib" python -m pytest -q tests/test_robustness.py
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The sample: every file whose tests reach the kernels through a different door (the KV caches: the reader's
# paged and quantized reads), minus what only measures.
SAMPLE = ["tests/test_robustness.py", "tests/test_fuzz.py", "tests/test_graph_api.py", "tests/test_functional.py",
          "tests/test_backward.py", "tests/test_backward_graph.py", "tests/test_sdpa_fusion.py", "tests/test_sycl.py",
          "tests/test_views.py", "tests/test_ops_reference.py", "tests/test_kv_cache.py", "tests/test_kv_quant.py"]
# alloc_dealloc_mismatch=0: the SYCL runtime's JIT (libsycl-jit.so, not ours) frees a new'd block with
# delete[] while enumerating devices; every other ASan check stays on.
ASAN_OPTIONS = "detect_leaks=0:alloc_dealloc_mismatch=0"
DESELECT = "not ten_thousand_mixed_calls"  # RSS under ASan's allocator measures ASan's quarantine
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


def _tool(name: str) -> str | None:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.sanitizer
def test_suite_sample_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    if os.environ.get("GRAPHATTN_SANITIZER_CHILD"):
        pytest.skip("already the sanitized run")
    libasan = _tool("libasan.so")
    if libasan is None:
        pytest.skip("no libasan.so beside the C++ compiler")
    for module in ("scikit_build_core", "Cython", "cython_cmake"):
        pytest.importorskip(module, reason="the sanitized build runs without build isolation")
    target = tmp_path / "site"
    # Without dpctl (the sycl extra) the SYCL tests skip, and the plugin, which needs its runtime, is left out.
    sycl = importlib.util.find_spec("dpctl") is not None
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--quiet",
         "-C", "cmake.define.GRAPHATTN_SANITIZE=address,undefined", "-C", "build-dir=build/sanitize",
         "-C", f"cmake.define.GRAPHATTN_BUILD_SYCL={'ON' if sycl else 'OFF'}",
         "--target", str(target), str(ROOT)], cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, f"sanitized build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    env = dict(os.environ, PYTHONPATH=str(target), LD_PRELOAD=libasan, GRAPHATTN_SANITIZER_CHILD="1",
               ASAN_OPTIONS=ASAN_OPTIONS, UBSAN_OPTIONS="print_stacktrace=1",
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(Path(sys.prefix) / "lib"),
                                                              os.environ.get("LD_LIBRARY_PATH")])))
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", DESELECT,
                            *SAMPLE], cwd=ROOT, env=env, capture_output=True, text=True)
    output = child.stdout + child.stderr
    print(output[-3000:])
    imported = subprocess.run([sys.executable, "-c", "import graphattn; print(graphattn.__file__)"], env=env,
                              capture_output=True, text=True).stdout.strip()
    assert imported.startswith(str(target)), f"the child imported {imported}, not the sanitized build"
    found = [line for line in output.splitlines() if any(r in line for r in REPORTS)]
    assert not found, "sanitizer reports:\n" + "\n".join(found[:20]) + "\n" + output[-6000:]
    assert child.returncode == 0, f"the sanitized sample failed (rc {child.returncode}):\n{output[-6000:]}"
