"""Draft tokens from a draft model (speculative decoding's "draft_model" method, as vLLM's): a
smaller model of the same vocabulary continues each sequence greedily, k tokens, and the model
verifies them in one step.

The draft model runs on a ModelRunner of its own with its own paged KV cache (as many blocks as
the model's, the same block size), driven through the same seam as the engine's: each proposal
round schedules SchedulerOutput steps over proposer-side copies of the sequences, whose blocks a
KVCacheManager without prefix caching hands out. A round, over every sequence that wants drafts:
one step computes what the draft cache lacks of each sequence's known tokens (its prompt at
first, then the tokens accepted since the last round and the one after them) and samples the
first draft, then k - 1 decode steps sample the others, each reading the one before on the
device. A long catch-up (a prompt) is split into chunks that sample nothing first.

After verification, what the draft cache holds is valid up to the first draft the model did not
keep: the next round recomputes from there, the runner's tokens past that point replaced by the
sequence's (ModelRunner.replace_tokens). A sequence whose blocks do not fit gets no drafts (its
draft state is dropped and rebuilt on a later round).
"""

from dataclasses import dataclass, replace

from minivllm.config import EngineConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.scheduler import StepBuilder
from minivllm.engine.sequence import Sequence
from minivllm.executor.model_runner import ModelRunner, StepHandle
from minivllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _DraftState:
    """A sequence as the draft side holds it."""

    # The draft runner's sequence: its own id, block table and computed tokens; its token_ids
    # are the sequence's known tokens as of the last round (the runner's copy then has the
    # round's drafts after them).
    copy: Sequence
    drafts: list[int]  # the last round's drafts


class DraftModelProposer:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        """config: the engine's (its draft_config set); num_blocks: the model's KV-cache blocks,
        which the draft cache gets as many of (the engine's memory accounting made room)."""
        assert config.draft_config is not None and config.speculative_config is not None
        draft_config = replace(config.draft_config, num_gpu_blocks_override=num_blocks)
        self.runner = ModelRunner(draft_config)
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self.num_speculative_tokens = config.speculative_config.num_speculative_tokens
        # Tokens a step may hold: as many as the runner's input buffers take.
        self.max_step_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self._states: dict[int, _DraftState] = {}  # by the sequence's id
        self._finished: list[int] = []  # draft runner ids to forget at its next step

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Per sequence, min(num_speculative_tokens, its max_tokens) greedy draft tokens to
        follow its known tokens; [] for one whose blocks do not fit."""
        rows: list[tuple[_DraftState, int]] = []  # (state, number of drafts)
        for seq, limit in zip(seqs, max_tokens):
            state = self._catch_up_state(seq)
            num_drafts = min(self.num_speculative_tokens, limit)
            copy = state.copy
            # The catch-up, then a decode for each draft but the last.
            if self.kv_cache_manager.allocate(copy, copy.num_tokens - copy.num_computed_tokens + num_drafts - 1):
                rows.append((state, num_drafts))
            else:
                self._drop(seq.seq_id)
        if not rows:
            return [[] for _ in seqs]
        self._run_round(rows)
        states = self._states
        return [states[seq.seq_id].drafts if seq.seq_id in states else [] for seq in seqs]

    def _catch_up_state(self, seq: Sequence) -> _DraftState:
        """seq's draft state, its computed count rolled back to what stays valid: the tokens
        known at the last round and its drafts up to the first the model did not keep (the last
        draft was never computed)."""
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _DraftState(
                Sequence(seq.request_id, seq.index, list(seq.token_ids), GREEDY), [])
            return state
        copy, known = state.copy, seq.token_ids
        num_known = len(copy.token_ids)
        matched = 0
        for draft, token in zip(state.drafts, known[num_known:]):
            if draft != token:
                break
            matched += 1
        # (At least the last known token is computed again: its logits give the first draft.)
        copy.num_computed_tokens = min(copy.num_computed_tokens, num_known + matched, len(known) - 1)
        if copy.runner_blocks >= 0:
            self.runner.replace_tokens(copy.seq_id, num_known, known[num_known:])
        copy.token_ids += known[num_known:]
        return state

    def _run_round(self, rows: list[tuple[_DraftState, int]]) -> None:
        """Run a round's steps; each row's drafts in its state. A step's tokens are read back
        once the next one is launched (the runner keeps two steps' host copies)."""
        by_copy_id = {state.copy.seq_id: state for state, _ in rows}
        for state, _ in rows:
            state.drafts = []
        in_flight: StepHandle | None = None

        def read_back(handle: StepHandle | None) -> None:
            if handle is not None:
                sampled = self.runner.collect(handle)
                for seq_id, tokens in zip(sampled.seq_ids, sampled.token_ids):
                    by_copy_id[seq_id].drafts += tokens

        remaining = [state.copy.num_tokens - state.copy.num_computed_tokens for state, _ in rows]
        while sum(remaining) > self.max_step_tokens:  # chunks of the catch-up that sample nothing
            step = StepBuilder()
            budget = self.max_step_tokens
            for i, (state, _) in enumerate(rows):
                num_new = min(remaining[i] - 1, budget)
                if num_new > 0:
                    step.add(state.copy, num_new)
                    remaining[i] -= num_new
                    budget -= num_new
            self._launch(step)
        step = StepBuilder()
        for (state, _), num_new in zip(rows, remaining):
            step.add(state.copy, num_new)
        in_flight = self._launch(step)
        for position in range(1, max(num_drafts for _, num_drafts in rows)):
            step = StepBuilder()
            for state, num_drafts in rows:
                if num_drafts > position:
                    step.add(state.copy, 1)
            launched = self._launch(step)
            read_back(in_flight)
            in_flight = launched
        read_back(in_flight)
        for state, _ in rows:
            state.copy.num_pending_tokens = 0  # (all read back)

    def _launch(self, step: StepBuilder) -> StepHandle | None:
        finished, self._finished = self._finished, []
        prepared = self.runner.prepare_forward(step.build(finished))
        forward = self.runner.launch_forward(prepared) if prepared is not None else None
        return self.runner.launch_sampling(forward) if forward is not None else None

    def _drop(self, seq_id: int) -> None:
        """Free a sequence's draft blocks and have the runner forget it."""
        state = self._states.pop(seq_id, None)
        if state is None:
            return
        self.kv_cache_manager.free(state.copy)
        if state.copy.runner_blocks >= 0:
            self._finished.append(state.copy.seq_id)

    def finish(self, seq: Sequence) -> None:
        self._drop(seq.seq_id)
