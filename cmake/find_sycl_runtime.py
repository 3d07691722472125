"""Prints the include and library directories of the installed intel-sycl-rt wheel (one per line), or nothing.

The wheel installs its headers and libsycl.so under the environment's
include/ and lib/ (the build environment's, under pip's build isolation), so
they are located through the distribution's file list.
"""
from importlib import metadata

try:
    dist = metadata.distribution("intel-sycl-rt")
except metadata.PackageNotFoundError:
    raise SystemExit(0)
include_dir = lib_dir = None
for f in dist.files or []:
    path = str(f).replace("\\", "/")
    if path.endswith("include/sycl/sycl.hpp"):
        include_dir = dist.locate_file(f).resolve().parent.parent
    elif path.rsplit("/", 1)[-1] == "libsycl.so":
        lib_dir = dist.locate_file(f).resolve().parent
if include_dir and lib_dir:
    print(include_dir)
    print(lib_dir)
