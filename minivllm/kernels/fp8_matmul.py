"""Linear layers with 128x128 block-scaled float8 weights (the fp8 checkpoints of Qwen3-*-FP8):
fused_moe.py's grouped GEMM with one expert and the rows in order.

The weight stays float8 in memory (half a 16-bit weight's bytes, which decode steps are bound
by), each tile widened to the activations' dtype in registers, and each block of K's product
scaled by its block's scale (times the activations' per-token group scale) as it is added.
"""

import torch

from minivllm.kernels.fused_moe import Fp8Operands, grouped_gemm, tile_config

# Tiles by rows, the first entry whose bound is >= M: narrow column blocks for decode batches
# (more programs over a skinny product), taller row blocks that reuse each weight tile for
# larger ones. Not swept: `python -m benchmarks.kernels.fused_moe --fp8` times them.
CONFIGS: dict[int, dict[str, int]] = {
    16: dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    1 << 62: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
}


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     x_scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ dequantised(weight)^T: [M, N] in out_dtype. weight [N, K] float8_e4m3fn with
    float32 weight_scale [blocks of N, blocks of K] (block: rows x columns under one scale, the
    columns a multiple of 16); x float8 with x_scale [M, blocks of K] (one scale per row and
    block of columns), or x_scale None and x in out_dtype."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    grouped_gemm(x, weight[None], out, None, None, 1, False, tile_config(CONFIGS, x.shape[0], out_dtype),
                 Fp8Operands(weight_scale[None], block, x_scale))
    return out
