"""Scheduler: picks each step's work under a token budget.

Running sequences go first (their decode token, or the next chunk of an unfinished
prompt), then waiting sequences fill the rest of the budget in FCFS order, their prompts
split into chunks when long. When KV blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later from the head of
the waiting queue.

With speculative decoding, draft tokens are proposed for a sequence (a DraftProposer's:
engine/ngram_proposer.py, engine/suffix_proposer.py, engine/draft_model_proposer.py) each time a
step read back grows its known tokens (propose, for all such sequences at once). A decoding
sequence whose tokens are all known takes them: its row computes them after its last token,
and the step verifies them. Its computed count then runs ahead by the drafts until the step is
read back (settle_drafts rolls it back to the accepted ones). A grammar-guided row's drafts meet
its grammar when its masks are filled (engine/structured_outputs.py).
"""

from collections import deque
from typing import Protocol

from minivllm.config import EngineConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.scheduler_output import BlockUpdate, NewSequenceData, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus


class DraftProposer(Protocol):
    """Speculative decoding's source of draft tokens (one per speculative_config method)."""

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Per sequence, at most its max_tokens draft tokens to follow its known tokens."""
        ...

    def finish(self, seq: Sequence) -> None:
        """seq finished (stopped, at its length limit, or aborted)."""
        ...


class StepBuilder:
    """Collects one step's rows, and what the runner lacks of their sequences (the scheduler's,
    and a draft model's runner's: engine/draft_model_proposer.py)."""

    __slots__ = (
        "block_updates",
        "draft_token_ids",
        "new_seqs",
        "num_admitted",
        "num_computed_tokens",
        "num_new_tokens",
        "samples",
        "seq_ids",
    )

    def __init__(self) -> None:
        self.seq_ids: list[int] = []
        self.num_new_tokens: list[int] = []
        self.num_computed_tokens: list[int] = []
        self.samples: list[bool] = []
        self.new_seqs: list[NewSequenceData] = []
        self.block_updates: list[BlockUpdate] = []
        self.num_admitted = 0
        self.draft_token_ids: dict[int, list[int]] = {}

    def add(self, seq: Sequence, num_new: int, drafts: list[int] | None = None) -> None:
        """Add seq's row and count the step's work as done (the runner runs it); drafts: the
        row's draft tokens, the last of its num_new tokens."""
        num_computed = seq.num_computed_tokens
        num_drafts = 0
        if drafts:
            num_drafts = len(drafts)
            self.draft_token_ids[seq.seq_id] = drafts
        samples = num_computed + num_new - num_drafts == seq.num_tokens
        self.seq_ids.append(seq.seq_id)
        self.num_new_tokens.append(num_new)
        self.num_computed_tokens.append(num_computed)
        self.samples.append(samples)
        seq.num_computed_tokens = num_computed + num_new
        if samples:
            seq.num_pending_tokens += 1  # its value comes back after the step runs
        table, sent = seq.block_table, seq.runner_blocks
        if len(table) > sent:  # (a decode inside its last block, the common row, skips this)
            if sent < 0:
                self.new_seqs.append(NewSequenceData(seq.seq_id, seq.prompt_token_ids, seq.params, seq.seed,
                                                     table[:], seq.num_prompt_logprobs))
            else:
                self.block_updates.append((seq.seq_id, sent, table[sent:]))
            seq.runner_blocks = len(table)

    def build(self, finished_seq_ids: list[int]) -> SchedulerOutput:
        return SchedulerOutput(self.seq_ids, self.num_new_tokens, self.num_computed_tokens, self.samples,
                               self.new_seqs, self.block_updates, finished_seq_ids, self.num_admitted,
                               self.draft_token_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 proposer: DraftProposer | None = None) -> None:
        """proposer: speculative decoding's drafts (LLMEngine makes it from speculative_config)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.proposer = proposer
        # The running sequences whose last proposal found draft tokens, and those drafts
        # (proposed from the tokens known then: all of the sequence's, once none is pending).
        self._proposals: dict[int, list[int]] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Sequences the runner has seen that finished since the last step (it drops them).
        self._finished_seq_ids: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        step = StepBuilder()
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
            drafts = self._drafts(seq, budget) if self.proposer is not None and num_new == 1 else []
            num_new += len(drafts)
            while not allocate(seq, num_new):
                if drafts:  # no preemption for drafts' sake: decode without them
                    num_new -= len(drafts)
                    drafts = []
                    continue
                preempted = True
                victim = running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                step.add(seq, num_new, drafts)
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
            step.add(seq, num_new)
            step.num_admitted += 1
            budget -= num_new
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return step.build(finished)

    @property
    def has_proposals(self) -> bool:
        """Some running sequence has draft tokens proposed: the engine reads each step back
        before it schedules the next, so that they follow its last token."""
        return bool(self._proposals)

    def propose(self, seqs: list[Sequence]) -> None:
        """Propose draft tokens for the sequences whose known tokens a step read back has just
        grown (their drafts settled), all at once: no more than could be kept (max_tokens,
        max_model_len: the drafts and the token after them must fit). None for a preempted
        sequence (it is recomputed first). With a token still pending, the proposal only says
        that drafts are likely: the next one, from all its tokens, decides."""
        assert self.proposer is not None  # (called with speculative decoding only)
        asked, rooms = [], []
        for seq in seqs:
            room = 0
            if seq.status is SequenceStatus.RUNNING:
                room = self.max_model_len - seq.num_tokens - 1
                max_tokens = seq.params.max_tokens
                if max_tokens is not None:
                    room = min(room, max_tokens - seq.num_output_tokens - 1)
            if room > 0:
                asked.append(seq)
                rooms.append(room)
            else:
                self._proposals.pop(seq.seq_id, None)
        for seq, drafts in zip(asked, self.proposer.propose(asked, rooms) if asked else []):
            if drafts:
                self._proposals[seq.seq_id] = drafts
            else:
                self._proposals.pop(seq.seq_id, None)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """A decoding sequence's proposed draft tokens that fit the step's token budget; none
        while a token of it is in flight (they would not follow its last token)."""
        if seq.num_pending_tokens:
            return []
        drafts = self._proposals.get(seq.seq_id)
        return drafts[:budget - 1] if drafts else []

    def settle_drafts(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a step verified num_drafts drafts of seq and its accepted tokens joined seq's
        known tokens: roll its computed count back to the accepted ones (the rejected ones'
        K/V stay in its blocks, overwritten by its next steps), and put the blocks the step
        completed with accepted tokens in the prefix cache (never those of rejected ones)."""
        end = seq.num_computed_tokens - (num_drafts - num_accepted)
        seq.num_computed_tokens = end
        start = end - 1 - num_accepted  # where the step's new tokens started
        self.kv_cache_manager.cache_full_blocks(seq, start, end)

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        self._proposals.pop(seq.seq_id, None)  # re-proposed once its recomputed prompt samples
        seq.runner_blocks = 0  # the runner keeps the sequence; its new table is sent whole
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
        if seq.runner_blocks >= 0:
            self._finished_seq_ids.append(seq.seq_id)
        seq.num_pending_tokens = 0  # whatever is still in flight for it is dropped
        if self.proposer is not None:
            self.proposer.finish(seq)
            self._proposals.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
        seq.stop_reason = stop_reason
