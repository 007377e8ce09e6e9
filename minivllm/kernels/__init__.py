"""Triton kernels (GPU; on CPU they run under Triton's interpreter, TRITON_INTERPRET=1).

Empty on purpose: importing the package must not import Triton, so that the torch path (CPU,
no Triton installed) can import minivllm.kernels.split_k. Triton helpers live in common.py."""
