"""Command line: ``python -m graphattn info`` prints the build, CPU and kernel facts."""
from __future__ import annotations

import argparse
import sys

import graphattn as ga
import graphattn.sycl_runtime


def _table_line(pass_name: str) -> str:
    """The pass's kernel candidates in the order they are tried, each with whether this CPU runs it."""
    entries = [f"{name} (not here: {missing})" if missing else f"{name} (runs here)"
               for name, missing in ga.kernel_candidates(pass_name)]
    forced = ga.kernel_choice.forced_kernels()[pass_name]
    return f"{pass_name} kernels, tried in order: {', '.join(entries)}" + (
        f"; forced: {forced}" if forced != ga.kernel_choice.AUTOMATIC else "")


def info() -> str:
    lines = [
        f"graphattn {ga.__version__}",
        f"python {sys.version.split()[0]}",
        f"cpu features: {' '.join(ga.cpu_features()) or '(none beyond the baseline)'}",
        f"openmp threads: {ga.thread_count()}",
        *(_table_line(pass_name) for pass_name in ("forward", "backward")),
        f"long calls run: forward (f32: {ga.forward_isa('f32')}, bf16: {ga.forward_isa('bf16')}, "
        f"f16: {ga.forward_isa('f16')}), backward (f32: {ga.backward_isa('f32')}, bf16: {ga.backward_isa('bf16')}, "
        f"f16: {ga.backward_isa('f16')}); other ops: reference (NumPy)",
        ga.sycl_runtime.describe(),
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
