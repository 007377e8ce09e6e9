"""LLM: the offline facade, as in vLLM: generate() and chat()."""

import time
import weakref
from collections.abc import Sequence as SequenceABC
from typing import Any, cast

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.input_processor import is_token_ids
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.entrypoints.chat_utils import Conversation, chat_prompt_token_ids
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        """kwargs: EngineConfig's fields (vLLM's names): dtype, max_model_len, max_num_seqs, ..."""
        self.llm_engine = LLMEngine(EngineConfig(model, **kwargs))
        # As vLLM: a deleted LLM (or one alive at exit) stops its tensor-parallel workers, so a
        # script can build another engine after `del llm`.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (a no-op without them)."""
        self._finalizer()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, as vLLM's LLM.reset_prefix_cache (after the weights
        change, or between a benchmark's runs). Only between generate() calls: True if reset."""
        return self.llm_engine.reset_prefix_cache()

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
        prompts = list(prompts)
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
