"""Command line: ``python -m graphattn info`` prints the build, CPU and kernel facts."""
from __future__ import annotations

import argparse
import sys

import graphattn as ga


def info() -> str:
    lines = [
        f"graphattn {ga.__version__}",
        f"python {sys.version.split()[0]}",
        f"cpu features: {' '.join(ga.cpu_features()) or '(none beyond the baseline)'}",
        f"openmp threads: {ga.thread_count()}",
        f"kernels: sdpa_forward_cpu (f32: {ga.forward_isa('f32')}, bf16: {ga.forward_isa('bf16')}, "
        f"f16: {ga.forward_isa('f16')}), "
        f"sdpa_backward_cpu (f32: {ga.backward_isa('f32')}, bf16: {ga.backward_isa('bf16')}, "
        f"f16: {ga.backward_isa('f16')}), "
        "reference (NumPy, every op)",
        "sycl devices: none (the SYCL plugin is not part of this build)",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphattn", description="graphattn command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, detected ISA features, threads, kernels and devices")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
