"""Tensor-parallel worker processes (ranks 1..N-1), and rank 0's handle on them.

Rank 0 runs the engine and its own shard; each worker runs a ModelRunner on its shard.
For every step, rank 0 writes the ModelRunner method to call and its arguments (the step's
prepared host-side arrays, StepInputs: only rank 0 keeps the sequences' state) into a
shared-memory buffer and signals each worker's event; the workers make the same call, so
every rank issues the same collectives in the same order. Start-up needs no messages: every
rank's ModelRunner loads, profiles, allocates its KV cache and captures its CUDA graphs in
the same order by construction.
"""

import atexit
import multiprocessing as mp
import pickle
import struct
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
import torch.distributed as dist

from minivllm import distributed
from minivllm.config import EngineConfig
from minivllm.executor.model_runner import ModelRunner

_HEADER = struct.Struct("<Q")  # byte length of the pickled message that follows it
_POLL_S = 1.0  # how often a waiting process checks that the other side is still alive
_STOP_TIMEOUT_S = 10.0


class _Channel:
    """One message at a time from rank 0 to every worker, through shared memory.

    Rank 0 writes a message only once every worker has read the previous one (each
    worker's `read` event), then sets each worker's `posted` event.
    """

    def __init__(self, num_workers: int, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.shm = SharedMemory(create=True, size=size)
        self.posted = [ctx.Event() for _ in range(num_workers)]
        self.read = [ctx.Event() for _ in range(num_workers)]
        for event in self.read:
            event.set()

    def send(self, message: object, workers: list[BaseProcess], timeout: float | None = None) -> None:
        """Raises RuntimeError if a worker died, TimeoutError if one is still busy after timeout."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if _HEADER.size + len(data) > self.shm.size:
            raise RuntimeError(f"A {len(data)}-byte step message exceeds the {self.shm.size}-byte channel.")
        for event, worker in zip(self.read, workers):
            waited = 0.0
            while not event.wait(_POLL_S):
                waited += _POLL_S
                if not worker.is_alive():
                    raise RuntimeError(f"Tensor-parallel worker {worker.name} died (exit code {worker.exitcode}).")
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"Tensor-parallel worker {worker.name} did not take the next message.")
            event.clear()
        buf = self.shm.buf
        assert buf is not None, "the channel is closed"
        _HEADER.pack_into(buf, 0, len(data))
        buf[_HEADER.size:_HEADER.size + len(data)] = data
        for event in self.posted:
            event.set()

    def receive(self, index: int) -> tuple[str, tuple[Any, ...]] | None:
        """Worker `index`'s next message, (ModelRunner method, its arguments); None once rank 0
        has died."""
        parent = mp.parent_process()
        while not self.posted[index].wait(_POLL_S):
            if parent is not None and not parent.is_alive():
                return None
        self.posted[index].clear()
        buf = self.shm.buf
        assert buf is not None, "the channel is closed"
        (length,) = _HEADER.unpack_from(buf, 0)
        message = pickle.loads(buf[_HEADER.size:_HEADER.size + length])  # a copy
        self.read[index].set()
        return message

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


def _channel_bytes(config: EngineConfig) -> int:
    """Room for the largest step message: 3 int64 fields per token, a block-table row and
    a few scalars per sequence; doubled, plus 1 MiB, for pickle's framing and host lists."""
    max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    per_seq = 4 * config.max_blocks_per_seq + 64
    return 2 * (24 * max_tokens + per_seq * config.max_num_seqs) + (1 << 20)


def start_rank(config: EngineConfig, rank: int, init_method: str, cuda_device: int) -> ModelRunner:
    """A worker rank's ModelRunner, in the process group (left again if it fails to build)."""
    distributed.init_distributed(rank, config.tensor_parallel_size, init_method, config.device, cuda_device)
    try:
        return ModelRunner(config)
    except BaseException:
        distributed.destroy_distributed()
        raise


def stop_rank(runner: ModelRunner) -> None:
    runner.release_graphs()  # before the process group goes
    distributed.destroy_distributed()


def _worker_main(config: EngineConfig, rank: int, init_method: str, channel: _Channel, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    runner = start_rank(config, rank, init_method, rank)
    try:
        # None: rank 0 asked us to stop, or died.
        while (message := channel.receive(rank - 1)) is not None:
            method, args = message
            getattr(runner, method)(*args)
    finally:
        stop_rank(runner)


class Workers:
    """Rank 0's handle on ranks 1..N-1: starts them, forwards calls to them, stops them."""

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise ValueError("A tensor-parallel engine is already running in this process: "
                             "shut it down (LLM.shutdown()) before starting another.")
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")  # forking a process that has touched CUDA is unsafe
        self.channel = _Channel(size - 1, _channel_bytes(config))
        init_method = distributed.free_init_method()
        # The ranks share the engine's intra-op threads (rank 0's count, cpu_threads' or the
        # user's): each rank its own count would put size times too many on the same cores.
        num_threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(num_threads)
        # Daemons: multiprocessing ends them if rank 0 exits without shutting down.
        self.processes: list[BaseProcess] = [
            ctx.Process(target=_worker_main, name=f"minivllm-tp{rank}", daemon=True,
                        args=(config, rank, init_method, self.channel, num_threads))
            for rank in range(1, size)]
        for process in self.processes:
            process.start()
        atexit.register(self.shutdown)
        try:
            distributed.init_distributed(0, size, init_method, config.device, 0)
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: object) -> None:
        """Have every worker run ModelRunner.<method>(*args); returns once it is queued."""
        if not self.processes:
            raise RuntimeError("The tensor-parallel workers were shut down: start a new engine.")
        self.channel.send((method, args), self.processes)

    def shutdown(self) -> None:
        """Stop the workers cleanly (or, if they don't stop in time, terminate them) and
        leave the process group. Safe to call more than once."""
        if not self.processes:
            return
        atexit.unregister(self.shutdown)
        try:
            self.channel.send(None, self.processes, timeout=_STOP_TIMEOUT_S)
        except (RuntimeError, TimeoutError):
            pass  # a dead or stuck worker: terminated below
        for process in self.processes:
            process.join(_STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join()
        self.processes = []
        distributed.destroy_distributed()
        self.channel.close()
