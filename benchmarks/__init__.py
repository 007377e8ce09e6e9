"""minivllm benchmarks: W1-W4 (throughput, latency, prefix_cache, serving) and, in kernels/,
kernel microbenchmarks; run them as modules from the repository root (`python -m benchmarks.throughput`)."""
