"""Sequence: one sample being generated (a request with n > 1 has n of them)."""

import enum
import itertools

from minivllm.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int | None = None, num_prompt_logprobs: int | None = None) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.params = params
        # Whether sampling reads this sequence's tokens so far (penalties, min_tokens): read
        # once here, since every step asks it of every running sequence.
        self.needs_token_history = params.needs_token_history
        self.seed = seed  # of its draws (hashed with each output position); None: unseeded
        # Candidates per prompt position whose logprobs this sequence's prefill computes (the
        # request's first sample only); None: none. Such a sequence computes its whole prompt:
        # it takes no prefix-cache hits (its blocks are cached for others all the same).
        self.num_prompt_logprobs = num_prompt_logprobs
        # The prompt as given (the request's list, which nothing changes) and the known tokens.
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)  # known tokens only
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens sampled on the GPU whose values the host has not read yet (the engine
        # schedules the next step before the last one's tokens come back).
        self.num_pending_tokens = 0
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache (or will be once the scheduled step runs).
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first admission (for metrics/tests).
        self.num_cached_tokens = 0
        self.block_table: list[int] = []  # KV blocks holding this sequence's tokens, in order
        # How many block_table entries the model runner holds (the scheduler sends it the
        # rest: SchedulerOutput.block_updates); -1 while the runner has not seen the sequence.
        self.runner_blocks = -1
        self.block_hashes: list[bytes] = []  # chained hashes of this sequence's full blocks
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, tuple[float, int]]] = []  # per output token: id -> (logprob, rank)

    @property
    def num_tokens(self) -> int:
        """Length including pending tokens: what the scheduler and the KV cache plan for."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The known generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_preempted(self) -> bool:
        """Waiting after it ran (its blocks were taken back; it is recomputed when readmitted)."""
        return self.status == SequenceStatus.WAITING and self.runner_blocks >= 0

    def length_limit_reached(self, max_model_len: int, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens may grow no further (max_tokens or a full context)."""
        max_tokens = self.params.max_tokens
        return num_tokens >= max_model_len or (
            max_tokens is not None and num_tokens - self.num_prompt_tokens >= max_tokens)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
