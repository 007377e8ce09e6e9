"""minivllm benchmarks (W1-W3 of BENCH.md); run the scripts from the repository root."""
