"""Engines as Ray actors (distributed_executor_backend="ray"), each in bundle 0 of its
replica's placement group (executor/ray_utils.py), on any node of the Ray cluster: AsyncLLM's
engine core (RayEngineCore), and an offline LLM's data-parallel replicas (RayReplica).

The core actor runs async_llm.run_engine_core, the same loop as a core process, on one of its
threads, over in-actor queues; the front puts commands and takes results through actor calls
on the others (the actor is threaded: a call waits for results while the loop runs).
"""

import logging
import queue
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import Command, CoreMessage, run_engine_core
from minivllm.executor.ray_utils import actor_options, initialize_ray_cluster, replica_placement_group, stop_actors

# How long one call waits for results when the front would wait for ever (it calls again).
_RECEIVE_S = 1.0
# How long a core that stopped answering has to tell why.
_EXIT_WAIT_S = 5.0
# How long a put or take call may take beyond its own wait before the core counts as gone.
_CALL_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 30.0


class QueueConnection:
    """One direction of a connection within a process, as the core loop uses a pipe's ends:
    send, poll and recv."""

    _NOTHING = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._next: Any = self._NOTHING  # what poll took off the queue, for recv

    def send(self, obj: Any) -> None:
        self._queue.put(obj)

    def poll(self, timeout: float = 0.0) -> bool:
        if self._next is self._NOTHING:
            try:
                self._next = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self) -> Any:
        if self._next is self._NOTHING:
            return self._queue.get()
        obj, self._next = self._next, self._NOTHING
        return obj


class _EngineCoreActor:
    """An engine core: run() on one thread for the core's life; put() and take() on others."""

    def __init__(self) -> None:
        self.commands = QueueConnection()
        self.results = QueueConnection()

    def run(self, config: EngineConfig, log_level: int) -> None:
        """The core loop, until the stop command (AsyncLLM's front ends with it)."""
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        run_engine_core(config, self.commands, self.results)

    def put(self, commands: list[Command]) -> None:
        for command in commands:
            self.commands.send(command)

    def take(self, timeout: float) -> list[CoreMessage]:
        """Every message the core sent, waiting up to timeout seconds for one."""
        messages: list[CoreMessage] = []
        while self.results.poll(0 if messages else timeout):
            messages.append(self.results.recv())
        return messages


_EngineCoreActorClass: Any = ray.remote(_EngineCoreActor)  # Any: ray's types do not follow a class to its actor


class RayEngineCore:
    """AsyncLLM's handle (async_llm.EngineCore) on an engine core actor. Starting it connects
    to the Ray cluster (or starts one) and reserves the replica's placement group."""

    def __init__(self, config: EngineConfig, data_parallel_size: int, log_level: int) -> None:
        initialize_ray_cluster(config, data_parallel_size)
        self.placement_group = replica_placement_group(config)
        # Threads: the loop's, and one each for the front's put and take calls.
        self.actor = _EngineCoreActorClass.options(max_concurrency=3,
                                                   **actor_options(config, self.placement_group, 0)).remote()
        self._run = self.actor.run.remote(config, log_level)  # done once the loop has ended

    def send(self, commands: list[Command]) -> None:
        try:
            ray.get(self.actor.put.remote(commands), timeout=_CALL_TIMEOUT_S)
        except RayError as error:  # GetTimeoutError too
            raise OSError(f"The engine actor is gone: {error}") from error

    def receive(self, timeout: float | None) -> list[CoreMessage]:
        wait = _RECEIVE_S if timeout is None else timeout
        try:
            while not (messages := ray.get(self.actor.take.remote(wait), timeout=wait + _CALL_TIMEOUT_S)):
                if timeout is not None:
                    break
        except RayError as error:  # GetTimeoutError too
            raise EOFError(f"The engine actor is gone: {error}") from error
        return messages

    def is_alive(self) -> bool:
        return not ray.wait([self._run], timeout=0)[0]

    def stop(self, timeout: float) -> None:
        stop_actors([self.actor], lambda: self._run, self.placement_group, timeout)

    def exit_error(self) -> BaseException:
        try:
            ray.get(self._run, timeout=_EXIT_WAIT_S)
        except GetTimeoutError:  # before RayError: it is one
            return RuntimeError("The engine actor stopped answering.")
        except RayError as error:
            return RuntimeError(f"The engine actor died: {error}")
        return RuntimeError("The engine actor ended without a word.")


class _LLMHost:
    """An offline LLM in an actor, running the LLM methods it is called with."""

    def start(self, model: str, kwargs: dict[str, Any]) -> None:
        from minivllm.llm import LLM  # the actor's process imports it, not the module's importers

        self.llm = LLM(model, **kwargs)

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        return getattr(self.llm, method)(*args)

    def stop(self) -> None:
        self.llm.shutdown()


_LLMHostClass: Any = ray.remote(_LLMHost)


class RayReplica:
    """An offline LLM's data-parallel replica as a Ray actor: llm.py's _Replica (a process of
    this host) over Ray. Each call's result (or what it raised) comes from result()."""

    def __init__(self, model: str, kwargs: dict[str, Any], config: EngineConfig, data_parallel_size: int) -> None:
        initialize_ray_cluster(config, data_parallel_size)
        self.placement_group = replica_placement_group(config)
        self.actor = _LLMHostClass.options(**actor_options(config, self.placement_group, 0)).remote()
        self._latest = self.actor.start.remote(model, kwargs)

    def send(self, method: str, *args: Any) -> None:
        self._latest = self.actor.call.remote(method, args)

    def result(self) -> Any:
        """What the latest call returned; raises what it raised (an instance of its class)."""
        return ray.get(self._latest)

    def stop(self) -> None:
        stop_actors([self.actor], self.actor.stop.remote, self.placement_group, _STOP_TIMEOUT_S)
