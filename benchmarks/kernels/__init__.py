"""Kernel microbenchmarks and profiles (run on a GPU: `python -m benchmarks.kernels.<name>`)."""
