"""Scheduler: picks each step's work under a token budget.

Running sequences go first (their decode token, or the next chunk of an unfinished
prompt), then waiting sequences fill the rest of the budget in FCFS order, their prompts
split into chunks when long. When KV blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later from the head of
the waiting queue.
"""

from collections import deque
from dataclasses import dataclass, field

from minivllm.config import EngineConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work, a row per sequence. Decodes first: the layout the runner, the
    Triton attention backend and the CUDA graphs rely on, stated here once.

    A running sequence has more than one new token only while its prompt is being chunked,
    and that can only be the most recently admitted one (a prompt is cut only when the
    budget runs out, so nothing is admitted after it in that step): every batch starts with
    its decodes (one new token each), then prompt chunks. `longest_decodes_first` sorts
    that leading run by context, longest first, since the decode kernel starts its programs
    in batch order. TritonAttentionBackend.attend sends the leading one-token rows of a
    mixed step to the split-KV decode kernel and the rest to the mixed kernel (a later
    one-token row would still be right, only slower); StepGraphs.padded_shape runs a mixed
    step that starts with a decode eagerly.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, this step
    # Tokens each sequence had computed before this step (where its new tokens start).
    num_computed_tokens: list[int] = field(default_factory=list)
    # Whether the step samples the sequence's next token (its last known token is computed).
    samples: list[bool] = field(default_factory=list)
    # How many of the last sequences came from the waiting queue this step (admitted).
    num_admitted: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int, samples: bool) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.num_computed_tokens.append(seq.num_computed_tokens)
        self.samples.append(samples)

    @property
    def num_leading_decodes(self) -> int:
        """The one-token sequences that lead the batch: its decodes (all of a decode-only step)."""
        return next((i for i, n in enumerate(self.num_new_tokens) if n != 1), len(self))

    def longest_decodes_first(self) -> "ScheduledBatch":
        """The batch with its leading one-token sequences (the decodes) ordered by context
        length, longest first; the rest as they are. The decode attention kernel starts its
        programs in batch order: this way no long context starts last and sets the launch's
        tail."""
        num_decodes = self.num_leading_decodes
        order = sorted(range(num_decodes), key=self.num_computed_tokens.__getitem__, reverse=True)
        order += range(num_decodes, len(self))
        return ScheduledBatch([self.seqs[i] for i in order], [self.num_new_tokens[i] for i in order],
                              [self.num_computed_tokens[i] for i in order], [self.samples[i] for i in order],
                              num_admitted=self.num_admitted)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        # 1. Running sequences: decodes and continuing prompt chunks, oldest first.
        i = 0
        running, allocate, max_model_len = self.running, self.kv_cache_manager.allocate, self.max_model_len
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens = seq.num_tokens
            if seq.length_limit_reached(max_model_len, num_tokens):
                i += 1  # finishes once its pending token is read back
                continue
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            while not allocate(seq, num_new):
                preempted = True
                victim = running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._schedule(batch, seq, num_new)
                budget -= num_new
                i += 1
        # 2. Waiting sequences, FCFS; not after a preemption (blocks are short this step).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached_prefix = self.kv_cache_manager.find_cached_prefix(seq)
            num_computed = len(cached_prefix) * self.kv_cache_manager.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.kv_cache_manager.allocate(seq, num_new, cached_prefix):
                break
            self.waiting.popleft()
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(batch, seq, num_new)
            batch.num_admitted += 1
            budget -= num_new
        return batch

    @staticmethod
    def _schedule(batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        """Add seq to the batch and count the step's work as done (the runner runs it)."""
        num_computed = seq.num_computed_tokens
        samples = num_computed + num_new == seq.num_tokens
        batch.add(seq, num_new, samples)
        seq.num_computed_tokens = num_computed + num_new
        if samples:
            seq.num_pending_tokens += 1  # its value comes back after the step runs

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, finish_reason: str, stop_reason: int | str | None = None) -> None:
        """Finish seq (stopped, length, or aborted) and free its blocks, wherever it is."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.kv_cache_manager.free(seq)
        seq.num_pending_tokens = 0  # whatever is still in flight for it is dropped
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        seq.stop_reason = stop_reason
