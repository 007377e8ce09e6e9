"""Tensor parallelism's process group and collectives (tensor_parallel.py), below the layers
that call them and the executor that sets the group up."""

from minivllm.distributed.tensor_parallel import (
                                                  all_reduce,
                                                  broadcast_from_rank0,
                                                  destroy_distributed,
                                                  free_init_method,
                                                  gather_to_rank0,
                                                  init_distributed,
                                                  min_across_ranks,
                                                  tp_rank,
                                                  tp_size,
)

__all__ = ["all_reduce", "broadcast_from_rank0", "destroy_distributed", "free_init_method",
           "gather_to_rank0", "init_distributed", "min_across_ranks", "tp_rank", "tp_size"]
