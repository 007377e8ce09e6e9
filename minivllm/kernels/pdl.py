"""Programmatic dependent launch (PDL; Hopper and later GPUs).

A kernel launched with PDL may start its programs while the kernel before it on the stream
is still running; each program then waits (griddepcontrol.wait) where it needs that
kernel's results. A batch-1 decode step is a few hundred short kernels back to back, and
with PDL each one's launch and set-up overlap the kernel before it instead of following it.
Captured in a CUDA graph, the overlap becomes part of the graph.

The contract every kernel here launched with PDL keeps:
* before `wait_for_previous_kernel` it writes nothing and reads only what the kernel just
  before it cannot be writing;
* every program calls it, so a kernel finishes only after the one before it has: kernels
  that follow without PDL (cuBLAS, torch) still find all earlier work done;
* the call also lets the next kernel's programs start, after the wait: so a kernel's
  programs start only once the kernel two before it has finished, and may read its
  results before waiting (the cascade's own-keys launch reads q and the KV cache that
  way, while the prefix launch before it runs).
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minivllm.kernels.common import INTERPRET


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the previous kernel on the stream has finished and its writes are
    visible, then let the next kernel's programs start. Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Launch with PDL on this device: a CUDA GPU of compute capability 9.0 or later, not
    under Triton's interpreter (which runs programs one after another anyway)."""
    return (device.type == "cuda" and not INTERPRET
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel that takes a PDL constexpr: PDL (its in-kernel waits)
    and Triton's launch_pdl, always equal: a kernel launched with PDL that did not wait would
    read its predecessor's output too early."""
    enabled = pdl_enabled(device)
    return {"PDL": enabled, "launch_pdl": enabled}
