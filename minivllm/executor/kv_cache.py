"""The paged KV cache's size and storage: how many blocks fit, and one tensor holding every
attention layer's K and V, which the layers see as views."""

import logging
import os
from collections.abc import Callable

import torch

from minivllm.config import EngineConfig
from minivllm.distributed import min_across_ranks
from minivllm.layers.attention import Attention, AttentionBackend

logger = logging.getLogger(__name__)

# Share of available RAM the KV cache takes on CPU when kv_cache_memory_bytes is not given.
_CPU_KV_CACHE_FRACTION = 0.25


def kv_bytes_per_block(layers: list[Attention], dtype: torch.dtype, block_size: int) -> int:
    attn = layers[0]
    return 2 * attn.num_kv_heads * attn.head_dim * dtype.itemsize * block_size * len(layers)


def num_kv_blocks(config: EngineConfig, block_bytes: int, device: torch.device,
                  profile_gpu_budget: Callable[[], int]) -> int:
    """Blocks for the cache: num_gpu_blocks_override, else kv_cache_memory_bytes, else on a
    GPU what profile_gpu_budget() says is left, on CPU a share of the free RAM. The same on
    every tensor-parallel rank (the smallest)."""
    if config.num_gpu_blocks_override is not None:
        budget = config.num_gpu_blocks_override * block_bytes
    elif config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = profile_gpu_budget()
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(available * _CPU_KV_CACHE_FRACTION)
        # No point holding more than every sequence at full length.
        budget = min(budget, config.max_num_seqs * config.max_blocks_per_seq * block_bytes)
    num_blocks = min_across_ranks(budget // block_bytes, device)
    if num_blocks < config.max_blocks_per_seq:
        raise ValueError(
            f"The KV cache has room for {num_blocks * config.block_size} tokens, less than one sequence "
            f"of max_model_len={config.max_model_len}: lower max_model_len, or give the cache more "
            "memory (gpu_memory_utilization / kv_cache_memory_bytes / num_gpu_blocks_override).")
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), at most %.1f sequences of max_model_len",
                num_blocks, config.block_size, num_blocks * block_bytes / 2**30,
                num_blocks / config.max_blocks_per_seq)
    return num_blocks


def allocate_kv_cache(layers: list[Attention], backend: AttentionBackend, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One allocation for all layers' K and V, [2, layers, blocks, block_size, Hkv, D]; each
    layer gets its views and the backend."""
    attn = layers[0]
    kv_cache = torch.empty(2, len(layers), num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                           dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
        layer.backend = backend
    return kv_cache


def release_kv_cache(layers: list[Attention]) -> None:
    """Drop the layers' views, so that the cache's memory goes with its last reference."""
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
