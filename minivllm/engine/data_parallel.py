"""Data parallelism on one host: N engine replicas behind one API front (vLLM's
`--data-parallel-size`).

Each replica is an AsyncLLM with an engine-core process of its own: the whole model (sharded
over tensor_parallel_size GPUs of its own on CUDA, a share of the cores on CPU) and its own KV
cache. A request (all prompts of it) goes to the live replica whose prefix cache most likely
holds the start of its first prompt (PrefixRouter), unless that replica is much busier than
the least busy one; otherwise to the live replica with the fewest unfinished requests (ties to
the lowest rank: one-at-a-time traffic stays on one replica). A replica whose core dies ends its own requests with
EngineDeadError; the others go on serving, and the server answers /health with 200 while one
lives. With distributed_executor_backend="ray" each replica's core is a Ray actor, on any host of
the Ray cluster (engine/ray_core.py).
"""

import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from minivllm.engine.input_processor import PromptType
from minivllm.engine.metrics import merged_registry
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


def replica_cuda_devices(config: EngineConfig, data_parallel_size: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each replica: replica i takes the visible GPUs
    i*tp .. i*tp+tp-1 (None for each on CPU, and with Ray, which gives each actor its GPU).
    Raises ValueError when there are too few."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
    if config.device != "cuda" or config.distributed_executor_backend == "ray":
        return [None] * data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    tp = config.tensor_parallel_size
    if data_parallel_size * tp > len(gpus):
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tp} needs "
                         f"{data_parallel_size * tp} GPUs, but {len(gpus)} are visible: lower data_parallel_size.")
    return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(data_parallel_size)]


# The prompt blocks a request records for routing (its first ones: what other requests share).
ROUTED_BLOCKS_PER_REQUEST = 64
# Block keys remembered per replica (least recently routed forgotten first): about what the
# prefix caches of a few thousand requests hold.
ROUTED_BLOCKS_PER_REPLICA = 100_000


class Router(Protocol):
    """Picks the replica of each request."""

    def choose(self, token_ids: Sequence[int], loads: list[int | None]) -> int:
        """The replica for a prompt, given each replica's unfinished requests (None: down)."""
        ...


class PrefixRouter:
    """Which replica a prompt goes to. Each replica remembers the keys of the prompt blocks
    routed to it (chained hashes of whole KV blocks, as its prefix cache keys them): a prompt
    goes where most of its leading blocks went before, so its prefix-cache hits stay on one
    replica, unless that replica has more than `slack` unfinished requests beyond the least
    busy one; then, and for a prompt seen nowhere, to the least busy one."""

    def __init__(self, num_replicas: int, block_size: int, slack: int = 8) -> None:
        self.block_size = block_size
        self.slack = slack
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def block_keys(self, token_ids: Sequence[int]) -> list[int]:
        keys, key = [], 0
        num_blocks = min(len(token_ids) // self.block_size, ROUTED_BLOCKS_PER_REQUEST)
        for start in range(0, num_blocks * self.block_size, self.block_size):
            key = hash((key, tuple(token_ids[start:start + self.block_size])))
            keys.append(key)
        return keys

    def choose(self, token_ids: Sequence[int], loads: list[int | None]) -> int:
        """The replica for a prompt, given each replica's unfinished requests (None: down);
        records the prompt's blocks there."""
        live = {rank: load for rank, load in enumerate(loads) if load is not None}
        least = min(live, key=live.__getitem__)  # the least busy; ties to the lowest rank
        keys = self.block_keys(token_ids)
        best, best_matched = least, 0
        for rank, load in live.items():
            seen = self.seen[rank]
            matched = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
            if matched > best_matched and load <= live[least] + self.slack:
                best, best_matched = rank, matched
        seen = self.seen[best]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > ROUTED_BLOCKS_PER_REPLICA:
            seen.popitem(last=False)
        return best


class DataParallelAsyncLLM:
    """AsyncLLM's interface over data_parallel_size replicas (see the module's docstring)."""

    def __init__(self, config: EngineConfig, data_parallel_size: int, model_name: str | None = None,
                 log_stats_interval_s: float | None = 10.0, router: Router | None = None) -> None:
        """Start every replica (their models load at once); returns once all are ready, or
        stops those that started and raises what stopped one. router: what picks each request's
        replica (default: a PrefixRouter)."""
        devices = replica_cuda_devices(config, data_parallel_size)
        if config.distributed_executor_backend == "ray":
            from minivllm.executor.ray_utils import initialize_ray_cluster  # ray: an optional extra

            initialize_ray_cluster(config, data_parallel_size)  # checks the whole cluster, from this thread
        with ThreadPoolExecutor(data_parallel_size, thread_name_prefix="minivllm-dp-start") as pool:
            starting = [pool.submit(AsyncLLM, config, model_name, log_stats_interval_s, rank, data_parallel_size,
                                    devices[rank]) for rank in range(data_parallel_size)]
            errors = [future.exception() for future in starting]
        self.replicas = [future.result() for future, error in zip(starting, errors) if error is None]
        if len(self.replicas) < data_parallel_size:
            self.shutdown()
            raise next(error for error in errors if error is not None)
        first = self.replicas[0]
        self.config = config
        self.tokenizer = first.tokenizer
        self.input_processor = first.input_processor
        self.metrics_registry = merged_registry([replica.metrics.registry for replica in self.replicas])
        self.router = router or PrefixRouter(data_parallel_size, config.block_size)
        self._request_counter = 0

    @property
    def is_running(self) -> bool:
        """Whether a replica still serves."""
        return any(replica.is_running for replica in self.replicas)

    @property
    def down_replicas(self) -> list[int]:
        """The ranks of the replicas whose core stopped."""
        return [rank for rank, replica in enumerate(self.replicas) if not replica.is_running]

    @property
    def vocab_size(self) -> int:
        return self.input_processor.vocab_size

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.replicas[0].encode(text, add_special_tokens)

    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None, arrival_time: float | None = None) -> RequestStream:
        (stream,) = await self.add_requests([prompt], params, [request_id], arrival_time)
        return stream

    async def add_requests(self, prompts: list[PromptType], params: SamplingParams | None,
                           request_ids: list[str | None], arrival_time: float | None = None) -> list[RequestStream]:
        """AsyncLLM.add_requests on the replica PrefixRouter picks for the first prompt.
        Text is tokenized first: the replica is chosen and the requests registered with it
        without an await between (else concurrent requests would all count the same loads)."""
        arrival_time = arrival_time or time.time()
        prompts = [await self.replicas[0].with_token_ids(prompt) for prompt in prompts]
        loads = [replica.num_unfinished_requests if replica.is_running else None for replica in self.replicas]
        if all(load is None for load in loads):
            raise EngineDeadError("Every engine has stopped; restart the server.")
        replica = self.replicas[self.router.choose(_token_ids(prompts[0]), loads)]
        # Ids unique across the replicas: each would otherwise count from 1.
        ids: list[str | None] = [request_id or self._next_request_id() for request_id in request_ids]
        return await replica.add_requests(prompts, params, ids, arrival_time)

    def _next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter)

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for output in await self.add_request(prompt, params, request_id):
            yield output

    def close(self, error: Callable[[], BaseException]) -> int:
        """AsyncLLM.close on every replica; returns how many requests were ended."""
        return sum(replica.close(error) for replica in self.replicas)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()


def _token_ids(prompt: PromptType) -> Sequence[int]:
    """A tokenized prompt's ids (after with_token_ids); none for a prompt in no form the engine
    takes (the replica refuses it)."""
    token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    return token_ids if isinstance(token_ids, list) else []


# What the server runs on: one engine, or replicas of it.
EngineClient = AsyncLLM | DataParallelAsyncLLM
