"""RequestOutput and CompletionOutput: what generate() returns (vLLM's shapes)."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability at one position (as in vLLM)."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# Per generated position: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position: token id -> Logprob (the prompt token plus the top-k); None for the
# first, which nothing precedes.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs' answer (None if not asked); a stream's first output only.
    prompt_logprobs: PromptLogprobs | None = None
