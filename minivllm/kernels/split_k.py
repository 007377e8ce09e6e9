"""Split-K matmul partial sums as a plain torch value: the layers pass them between the Triton
matmuls and fused_ops, and name the type without importing Triton."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitKPartials:
    """A matmul's output left as fp32 partial sums over split K ranges
    (skinny_matmul.skinny_matmul_partials, batch_matmul with partial_sums), for a consumer that
    adds them up as it loads them (fused_ops.add_rms_norm): row r of the output is
    parts[0, r] + parts[1, r] + ..., summed in that order in fp32 and rounded to `dtype`."""
    parts: torch.Tensor  # [SPLIT_K, workspace rows (>= num_rows), N] fp32, N contiguous
    num_rows: int
    dtype: torch.dtype
