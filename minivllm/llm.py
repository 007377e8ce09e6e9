"""LLM: the offline facade, as in vLLM: generate() and chat()."""

import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any, cast

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig, cpu_threads
from minivllm.engine.async_llm import picklable
from minivllm.engine.data_parallel import replica_cuda_devices
from minivllm.engine.input_processor import is_token_ids
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.entrypoints.chat_utils import Conversation, chat_prompt_token_ids
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.ray_core import RayReplica


class LLM:
    def __init__(self, model: str, data_parallel_size: int = 1, **kwargs: Any) -> None:
        """kwargs: EngineConfig's fields (vLLM's names): dtype, max_model_len, max_num_seqs, ...
        data_parallel_size: engine replicas; generate() splits the prompts among them. This
        process runs the first; each other runs in a process of its own, on its own
        tensor_parallel_size GPUs (replica i on GPUs i*tp .. i*tp+tp-1), or all of them on a
        1/data_parallel_size share of the CPU cores (this process's torch threads included).
        With distributed_executor_backend="ray" the others, and the tensor-parallel ranks after
        this process's, are Ray actors on the Ray cluster's GPUs (or CPUs)."""
        config = EngineConfig(model, **kwargs)
        devices = replica_cuda_devices(config, data_parallel_size)
        num_threads = cpu_threads(num_engines=data_parallel_size)
        # Started first: the replicas load their models while this process loads its own.
        self._replicas: list[_Replica | RayReplica]
        if config.distributed_executor_backend == "ray":
            from minivllm.engine import ray_core  # ray: an optional extra

            self._replicas = [ray_core.RayReplica(model, kwargs, config, data_parallel_size)
                              for _ in range(1, data_parallel_size)]
        else:
            self._replicas = [_Replica(model, kwargs, devices[rank], num_threads)
                              for rank in range(1, data_parallel_size)]
        if self._replicas and config.device == "cpu" and config.distributed_executor_backend == "mp":
            torch.set_num_threads(num_threads)
        try:
            self.llm_engine = LLMEngine(config)
        except BaseException:
            _stop_replicas(self._replicas)
            raise
        # As vLLM: a deleted LLM (or one alive at exit) stops its replicas and tensor-parallel
        # workers, so a script can build another engine after `del llm`.
        self._finalizer = weakref.finalize(self, _stop_replicas, self._replicas, self.llm_engine)
        try:
            for replica in self._replicas:
                replica.result()  # its LLM built, or what stopped it raised
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the replicas and the engine's tensor-parallel worker processes (a no-op without them)."""
        self._finalizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, as vLLM's LLM.reset_prefix_cache (after the weights
        change, or between a benchmark's runs). Only between generate() calls: True if reset."""
        for replica in self._replicas:
            replica.send("reset_prefix_cache")
        reset = self.llm_engine.reset_prefix_cache()
        return all([reset, *(replica.result() for replica in self._replicas)])

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The engine's tokenizer; None with skip_tokenizer_init."""
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A prompt is a string,
        token ids (a list of ints, or a 1-D numpy array or tensor) or vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]} dict; an empty list of prompts gives an empty list."""
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            prompts = [cast(PromptType, prompts)]  # one prompt
        elif not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts (strings, token-id lists or "
                             f"dicts), got {type(prompts).__name__}.")
        prompts = cast(list[PromptType], list(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)) or not all(
                    isinstance(params, SamplingParams) for params in sampling_params):
                raise ValueError("sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                 f"got {sampling_params!r}.")
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts: "
                                 "pass one, or one per prompt.")
        if self._replicas:
            return self._generate_data_parallel(prompts, params_list, use_tqdm)
        return self._generate_here(prompts, params_list, use_tqdm)

    def _generate_here(self, prompts: list[PromptType], params_list: list[SamplingParams],
                       use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = engine.next_request_id()
                try:
                    engine.add_request(request_id, prompt, params)
                except ValueError as error:
                    raise ValueError(f"Prompt {index}: {error}" if len(prompts) > 1 else str(error)) from error
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:  # leave the engine as it was
                engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def _generate_data_parallel(self, prompts: list[PromptType], params_list: list[SamplingParams],
                                use_tqdm: bool) -> list[RequestOutput]:
        """Every prompt checked (and tokenized) here first, so that a bad one raises before any
        runs; then a contiguous slice to each replica, this process's first."""
        checked: list[PromptType] = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                text, token_ids = self.llm_engine.input_processor.process(prompt, params)
            except ValueError as error:
                raise ValueError(f"Prompt {index}: {error}" if len(prompts) > 1 else str(error)) from error
            checked.append({"prompt_token_ids": token_ids} if text is None else
                           {"prompt": text, "prompt_token_ids": token_ids})
        size = len(self._replicas) + 1
        bounds = [len(checked) * rank // size for rank in range(size + 1)]
        for rank, replica in enumerate(self._replicas, start=1):
            replica.send("generate", checked[bounds[rank]:bounds[rank + 1]], params_list[bounds[rank]:bounds[rank + 1]],
                         False)
        outputs = self._generate_here(checked[:bounds[1]], params_list[:bounds[1]], use_tqdm)
        results = []
        for replica in self._replicas:  # each one's result read, so that none is left in its pipe
            try:
                results.append(replica.result())
            except Exception as error:  # noqa: BLE001 (re-raised once all are read)
                results.append(error)
        for result in results:
            if isinstance(result, Exception):
                raise result
            outputs += result
        return outputs

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        if not messages:
            raise ValueError("chat() got no messages: pass a conversation (a list of message dicts such as "
                             "{'role': 'user', 'content': 'Hi'}) or a list of conversations.")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": chat_prompt_token_ids(self.get_tokenizer(), conversation,
                                                              add_generation_prompt)}
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        prefill_start, decode_start = engine.num_prefill_tokens, engine.num_decode_tokens
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    progress.update(1)
            elapsed = max(time.perf_counter() - start, 1e-9)
            progress.set_postfix_str(
                f"prefill {(engine.num_prefill_tokens - prefill_start) / elapsed:.0f} tok/s, "
                f"decode {(engine.num_decode_tokens - decode_start) / elapsed:.0f} tok/s", refresh=False)
        progress.close()
        return [finished[request_id] for request_id in request_ids]


class _Replica:
    """A data-parallel replica: an LLM in a process of its own, that runs the LLM methods it is
    sent one at a time. Messages: (method name, args) or None (stop) down; ("ok", result) or
    ("error", exception) up, the first once its LLM is built."""

    def __init__(self, model: str, kwargs: dict[str, Any], cuda_visible_devices: str | None,
                 num_threads: int) -> None:
        ctx = mp.get_context("spawn")  # forking a process that may have touched CUDA is unsafe
        self._pipe, child_pipe = ctx.Pipe()
        # Not a daemon: its engine may start tensor-parallel workers of its own.
        self.process = ctx.Process(target=_replica_main, name="minivllm-replica",
                                   args=(model, kwargs, cuda_visible_devices, num_threads, child_pipe))
        self.process.start()
        child_pipe.close()

    def send(self, method: str, *args: Any) -> None:
        self._pipe.send((method, args))

    def result(self) -> Any:
        """What the latest call returned; raises what it raised."""
        try:
            kind, payload = self._pipe.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"A data-parallel replica exited (code {self.process.exitcode}).") from None
        if kind == "error":
            raise payload
        return payload

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._pipe.send(None)
            except OSError:
                pass  # it is exiting
            self.process.join(30)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join()
        self._pipe.close()


def _stop_replicas(replicas: "list[_Replica | RayReplica]", engine: LLMEngine | None = None) -> None:
    for replica in replicas:
        replica.stop()
    if engine is not None:
        engine.shutdown()


def _replica_main(model: str, kwargs: dict[str, Any], cuda_visible_devices: str | None, num_threads: int,
                  pipe: Any) -> None:
    if cuda_visible_devices is not None:  # before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    torch.set_num_threads(num_threads)
    try:
        llm = LLM(model, **kwargs)
    except BaseException as error:  # noqa: BLE001 (the front raises it)
        pipe.send(("error", picklable(error)))
        return
    pipe.send(("ok", None))
    try:
        while (command := pipe.recv()) is not None:
            method, args = command
            try:
                pipe.send(("ok", getattr(llm, method)(*args)))
            except Exception as error:  # noqa: BLE001 (the front raises it)
                pipe.send(("error", picklable(error)))
    except EOFError:
        pass  # the front is gone
    finally:
        llm.shutdown()
