"""SchedulerOutput: what the scheduler tells the model runner about one step (vLLM v1's seam).

Plain data, nothing of the engine's live objects: the scheduler builds it and the runner
reads it, and neither side reaches into the other. The runner keeps what it needs of each
sequence between steps (executor/persistent_batch.py: token ids, block table, sampling
parameters, seed) and appends the tokens it samples itself, so a step carries only
what changed: sequences the runner has not seen yet, block-table entries it lacks, and
sequences it may forget. A preempted sequence keeps its state in the runner (its tokens):
admitted again, it comes back as a block update from entry 0.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams

# (seq_id, start, block ids): the sequence's block-table entries from index `start` on are
# these (entries past them dropped). Appending a block is (seq_id, len(table), [block]);
# a preempted sequence's new table, admitted again, is (seq_id, 0, table).
BlockUpdate = tuple[int, int, list[int]]


@dataclass(frozen=True, slots=True)
class NewSequenceData:
    """A sequence the runner sees for the first time: what it keeps of it until the
    sequence is in a step's finished_seq_ids."""

    seq_id: int
    # The prompt, which nothing changes (the request's list): the runner copies it into the
    # token list it grows with the sequence's sampled tokens.
    prompt_token_ids: list[int]
    params: SamplingParams
    # The seed of the sequence's draws (the sampler hashes it with each output position), so
    # that a seeded sample does not depend on the rest of the batch; None: unseeded.
    seed: int | None
    block_ids: list[int]  # its block table
    # Top candidates per prompt position whose logprobs its prefill computes; None: none.
    num_prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step, a row per scheduled sequence (the columns seq_ids .. samples), in the
    scheduler's order: the running sequences, then those admitted this step.

    The runner may run the rows in any order, but it returns the sampled rows' results in
    this one.

    Speculative decoding adds draft tokens to some rows (draft_token_ids): such a row's new
    tokens are its last known token, then its drafts; the runner samples at each of them and
    returns the accepted drafts and one more token (each row's result is a list). Structured
    outputs' grammar bitmask comes apart (GrammarBitmask): it needs the tokens of the step
    still in flight when this one is scheduled.
    """

    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step
    # Tokens each row had computed before this step: where its new tokens start (0, or the end
    # of a prefix-cache hit, for a sequence admitted again after a preemption).
    num_computed_tokens: list[int] = field(default_factory=list)
    # Whether the step samples the row's next token (its new tokens reach its last token,
    # known or still pending on the device).
    samples: list[bool] = field(default_factory=list)
    new_seqs: list[NewSequenceData] = field(default_factory=list)  # first sight
    block_updates: list[BlockUpdate] = field(default_factory=list)
    # Sequences finished (or aborted) since the last step that the runner has seen: it drops
    # their state. Tokens of theirs still in flight are collected and ignored.
    finished_seq_ids: list[int] = field(default_factory=list)
    # How many of the last rows came from the waiting queue this step (admitted).
    num_admitted: int = 0
    # The draft tokens of the rows that have any, by sequence id (few rows have them: a
    # sparse column). They count in the row's num_new_tokens, after its last known token.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """The tokens each grammar-guided position of a step may sample (engine/structured_outputs.py),
    handed to the runner's launch_sampling once the previous step's tokens are known.

    xgrammar's layout: bit t % 32 of word t // 32 of a row is token t, 1 = allowed; every other
    token (and rows not listed) stays as it is."""

    # int64: the masked positions among the step's sampled logits (a row with d draft tokens
    # samples 1 + d positions, in the scheduler's order of rows), one per bitmask row; None:
    # every sampled position, in order.
    rows: np.ndarray | None
    # int32 [rows or sampled positions, ceil(vocab_size / 32)] on the host (pinned where CUDA copies it)
    bitmask: torch.Tensor
