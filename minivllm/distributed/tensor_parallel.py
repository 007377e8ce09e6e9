"""Tensor-parallel process group: set-up and tear-down, and the collectives the model
layers use. Every rank is its own process; the default torch.distributed group is the
tensor-parallel group, so at most one tensor-parallel engine runs in a process."""

import socket

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def free_init_method(host: str = "127.0.0.1") -> str:
    """A TCP rendezvous address on a port of this machine that is free now (rank 0 listens on
    it); host: the address the other ranks reach this machine at (another node's: its IP)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def init_distributed(rank: int, world_size: int, init_method: str, device: str, cuda_device: int) -> None:
    """Join the group; blocks until every rank has joined. NCCL on GPUs (this rank's is
    cuda_device), gloo on CPU."""
    if device == "cuda":
        torch.cuda.set_device(cuda_device)  # before the NCCL communicator binds to a device
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world_size)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def broadcast_from_rank0(x: torch.Tensor) -> None:
    """Overwrite x, in place, on every rank with rank 0's x."""
    if tp_size() > 1:
        dist.broadcast(x, src=0)


def min_across_ranks(value: int, device: torch.device) -> int:
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's shard of x along dim on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x.contiguous(), shards, dst=0)
    return torch.cat(shards, dim=dim) if shards is not None else None
