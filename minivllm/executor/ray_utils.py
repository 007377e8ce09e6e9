"""Ray: tensor-parallel ranks and data-parallel replicas as actors over a Ray cluster
(distributed_executor_backend="ray", as vLLM's). Imported only with that backend: ray is the
optional extra `minivllm[ray]`.

Each replica takes a placement group of one bundle a rank ({"GPU": 1} on CUDA, {"CPU": 1} on
CPU), packed onto as few nodes as hold them: bundle 0 holds the replica's engine core, rank 0
(engine/ray_core.py), bundles 1.. its RayWorkers. The ranks meet at a free port of rank 0's
node IP, so a tensor-parallel group may span nodes: NCCL between GPUs, gloo on CPU.
"""

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import ray
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minivllm import distributed
from minivllm.config import EngineConfig
from minivllm.executor.model_runner import ModelRunner
from minivllm.executor.worker import start_rank, stop_rank

logger = logging.getLogger(__name__)

# How long a replica waits for its placement group: the cluster has the resources, but other
# jobs hold them, or nodes are still joining (a slow start is no failure).
PLACEMENT_GROUP_TIMEOUT_S = 1800.0
_PLACEMENT_LOG_INTERVAL_S = 10.0
_STOP_TIMEOUT_S = 10.0


def _resource(config: EngineConfig) -> str:
    """What a rank takes of the cluster: a GPU, or a CPU."""
    return "GPU" if config.device == "cuda" else "CPU"


def initialize_ray_cluster(config: EngineConfig, data_parallel_size: int) -> None:
    """Connect to the Ray cluster ($RAY_ADDRESS, else the one `ray start` began on this host),
    or start a local one where there is none. Raises ValueError when the cluster has fewer GPUs
    (CPUs on CPU) than the tensor_parallel_size x data_parallel_size ranks need."""
    if not ray.is_initialized():
        # A local instance started here shares this process's group, and Ctrl-C in a terminal
        # would stop it before the server has stopped its actors (whose calls then hang): its
        # processes inherit SIGINT ignored, and stop with this one. (Only the main thread may
        # set signal handlers.)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            ray.init()  # no address: $RAY_ADDRESS, else this host's `ray start` cluster, else a new one
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
    resource = _resource(config)
    needed = config.tensor_parallel_size * data_parallel_size
    total = int(ray.cluster_resources().get(resource, 0))
    if needed > total:
        nodes = [int(node["Resources"].get(resource, 0)) for node in ray.nodes() if node["Alive"]]
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} x data_parallel_size="
                         f"{data_parallel_size} needs {needed} {resource}s in the Ray cluster, but it has {total} "
                         f"({len(nodes)} nodes with {nodes}): add nodes (`ray start --address=HEAD_IP:6379` on "
                         "each) or lower the sizes.")


def replica_placement_group(config: EngineConfig, first_bundle_here: bool = False) -> PlacementGroup:
    """A placement group for one replica's ranks, once Ray has reserved it; first_bundle_here:
    its bundle 0 on this node (for rank 0 in this process). Raises ValueError if it is not ready
    within PLACEMENT_GROUP_TIMEOUT_S, saying what it needs and what is free."""
    resource = _resource(config)
    bundles: list[dict[str, float]] = [{resource: 1.0} for _ in range(config.tensor_parallel_size)]
    if first_bundle_here:  # each node has 1 of its own `node:IP` resource
        bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
    group = placement_group(bundles, strategy="PACK")
    ready = group.ready()
    waited = 0.0
    while not ray.wait([ready], timeout=_PLACEMENT_LOG_INTERVAL_S)[0]:
        waited += _PLACEMENT_LOG_INTERVAL_S
        free = ray.available_resources().get(resource, 0)
        if waited >= PLACEMENT_GROUP_TIMEOUT_S:
            remove_placement_group(group)
            raise ValueError(f"Ray did not place a replica's placement group ({len(bundles)} x {{{resource!r}: 1}}) "
                             f"within {waited:g} s: the cluster has {free:g} {resource}s free of "
                             f"{ray.cluster_resources().get(resource, 0):g}. Free them or add nodes.")
        logger.info("Waiting for %d %ss for a replica's placement group (%g free in the cluster)", len(bundles),
                    resource, free)
    return group


def actor_options(config: EngineConfig, group: PlacementGroup, bundle_index: int) -> dict[str, Any]:
    """Ray options that run an actor in one bundle of the group, on that bundle's GPU or CPU."""
    resources = {"num_gpus": 1, "num_cpus": 0} if config.device == "cuda" else {"num_cpus": 1}
    return {**resources, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=bundle_index)}


def stop_actors(actors: list[Any], last_calls: Callable[[], Any], group: PlacementGroup | None,
                timeout: float) -> None:
    """Give actors up to timeout seconds to finish the calls last_calls makes (their own stop,
    or the call that ends with their loop), then kill them and free their placement group (if
    one is theirs). Nothing to do once Ray has shut down (at exit, say): it ended them with it."""
    if not ray.is_initialized():
        return
    try:
        ray.get(last_calls(), timeout=timeout)
    except ray.exceptions.RayError:  # GetTimeoutError too
        pass  # dead already, or stuck: killed below
    for actor in actors:
        ray.kill(actor)
    if group is not None:
        remove_placement_group(group)


class _Rank:
    """A tensor-parallel worker rank (1..N-1) as a Ray actor: its ModelRunner runs the calls
    rank 0 sends, one at a time, in order."""

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None

    def gpu_ids(self) -> list[int]:
        """The GPU Ray gave this actor (none on CPU), as numbered on its node."""
        return [int(gpu_id) for gpu_id in ray.get_gpu_ids()]

    def start(self, config: EngineConfig, rank: int, init_method: str) -> None:
        # Ray shows an actor only its own GPU, so it is device 0.
        self.runner = start_rank(config, rank, init_method, 0)

    def execute(self, method: str, args: tuple[Any, ...]) -> None:
        assert self.runner is not None, "start() runs first"
        getattr(self.runner, method)(*args)

    def stop(self) -> None:
        if self.runner is not None:
            stop_rank(self.runner)
            self.runner = None


_RankActor: Any = ray.remote(_Rank)  # Any: ray's types do not follow a class's methods to its actor


class RayWorkers:
    """Rank 0's handle on ranks 1..N-1 as Ray actors in the bundles after its own
    (executor/worker.py's Workers is the same on one host, as processes). Rank 0 is an actor of
    a replica's placement group (a served engine core), or this process (an offline LLM): then
    the group is its own, with bundle 0 on this node, held by an actor that keeps its GPU from
    others and tells rank 0 which it is."""

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise ValueError("A tensor-parallel engine is already running in this process: "
                             "shut it down before starting another.")
        self.actors: list[Any] = []
        self._own_group: PlacementGroup | None = None
        group = ray.util.get_current_placement_group()
        cuda_device = 0  # Ray shows an actor only its own GPU
        if group is None:
            initialize_ray_cluster(config, 1)
            group = self._own_group = replica_placement_group(config, first_bundle_here=True)
            self.actors.append(_RankActor.options(**actor_options(config, group, 0)).remote())
            if config.device == "cuda":
                cuda_device = _local_cuda_index(ray.get(self.actors[0].gpu_ids.remote())[0])
        size = config.tensor_parallel_size
        init_method = distributed.free_init_method(ray.util.get_node_ip_address())
        self.workers = [_RankActor.options(**actor_options(config, group, rank)).remote() for rank in range(1, size)]
        self.actors += self.workers
        # Each rank's latest calls not yet seen done: a failed one raises at the next call.
        self._pending = [actor.start.remote(config, rank, init_method) for rank, actor in enumerate(self.workers, 1)]
        try:
            distributed.init_distributed(0, size, init_method, config.device, cuda_device)
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: object) -> None:
        """Have every worker run ModelRunner.<method>(*args); returns once it is queued. Raises
        what a worker's earlier call raised (RayActorError if it died)."""
        if not self.actors:
            raise RuntimeError("The tensor-parallel workers were shut down: start a new engine.")
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        ray.get(done)
        step = ray.put(args)  # serialized once for all the workers
        self._pending += [actor.execute.remote(method, step) for actor in self.workers]

    def shutdown(self) -> None:
        """Stop the workers cleanly (or, if they don't stop in time, kill them) and leave the
        process group. Safe to call more than once."""
        if not self.actors:
            return
        workers = self.workers
        stop_actors(self.actors, lambda: [actor.stop.remote() for actor in workers], self._own_group, _STOP_TIMEOUT_S)
        self.actors = self.workers = []
        distributed.destroy_distributed()


def _local_cuda_index(gpu_id: int) -> int:
    """This process's index of the node's GPU gpu_id (its CUDA_VISIBLE_DEVICES may renumber)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",").index(str(gpu_id)) if visible else gpu_id
