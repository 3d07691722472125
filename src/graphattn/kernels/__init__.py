"""Kernels a compiled partition can run: fused native kernels and the NumPy reference."""
