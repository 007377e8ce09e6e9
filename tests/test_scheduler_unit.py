"""Scheduler.schedule on its own (CPU, no model): a real KVCacheManager and hand-made
Sequences. The engine's part is played by `read_back`, which makes the tokens a step
sampled known, as LLMEngine does once the step comes back; the runner's part by a
PersistentBatch that takes in every SchedulerOutput (MirroredScheduler).

Each test protects one scheduling rule users depend on: the token budget and chunked
prompts, max_num_seqs, running sequences before waiting ones (FCFS), preemption of the
newest running sequence (and of a sequence by itself), no admission in a step that
preempted, and prefix-cache hits that skip computed tokens on admission. Every step also checks
that the batch ends with the sequences it admitted, counted by num_admitted, and that the
runner, from the outputs' changes alone, holds every scheduled sequence's block table.
"""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.executor.persistent_batch import PersistentBatch
from tests.conftest import TinyModelFactory

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
SAMPLED_TOKEN = 5  # the value read_back gives every sampled token

Row = tuple[str, int, int, bool]  # (request id, computed tokens before the step, new tokens, samples)
Scheduled = tuple[SchedulerOutput, list[Sequence]]  # a step and its rows' sequences


class MirroredScheduler(Scheduler):
    """A Scheduler whose every output goes to a runner's PersistentBatch, which must then
    hold each scheduled sequence's prompt and block table, and exactly the sequences it was
    shown that have not finished (preempted ones included)."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        super().__init__(config, kv_cache_manager)
        self.runner = PersistentBatch()
        self.added: dict[int, Sequence] = {}  # every sequence added, by id

    def add(self, seq: Sequence) -> None:
        self.added[seq.seq_id] = seq
        super().add(seq)

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.runner.update(out)
        for seq_id in out.seq_ids:
            seq, state = self.added[seq_id], self.runner.states[seq_id]
            assert state.block_table == seq.block_table
            assert state.token_ids[:state.num_prompt_tokens] == seq.prompt_token_ids
        shown = {seq.seq_id for seq in [*self.running, *self.waiting] if seq.runner_blocks >= 0}
        assert set(self.runner.states) == shown
        return out


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: TinyModelFactory) -> str:
    """A tiny model directory: EngineConfig validates its knobs against its config.json."""
    return tiny_model_factory("Qwen3ForCausalLM")


def make_scheduler(model_dir: str, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int = 8,
                   enable_prefix_caching: bool = False) -> MirroredScheduler:
    """A Scheduler over a fresh KVCacheManager of num_blocks blocks of BLOCK_SIZE tokens."""
    config = EngineConfig(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching)
    return MirroredScheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching))


def make_seq(request_id: str, prompt: int | list[int], max_tokens: int = 32) -> Sequence:
    """A sequence whose prompt is the given token ids, or that many ids unique to request_id
    (so unrelated prompts never share a cached block)."""
    if isinstance(prompt, int):
        base = 1000 * sum(map(ord, request_id))
        prompt = [base + i for i in range(prompt)]
    return Sequence(request_id, 0, prompt, SamplingParams(max_tokens=max_tokens))


def schedule(scheduler: MirroredScheduler) -> Scheduled:
    """Schedule one step: its output, and its rows' sequences."""
    out = scheduler.schedule()
    return out, [scheduler.added[seq_id] for seq_id in out.seq_ids]


def rows(scheduled: Scheduled) -> list[Row]:
    out, seqs = scheduled
    return [(seq.request_id, computed, new, samples) for seq, computed, new, samples
            in zip(seqs, out.num_computed_tokens, out.num_new_tokens, out.samples)]


def read_back(scheduled: Scheduled) -> None:
    """What the engine does when a step comes back: each sampled token becomes known."""
    out, seqs = scheduled
    for seq, samples in zip(seqs, out.samples):
        if samples and not seq.is_finished:
            seq.token_ids.append(SAMPLED_TOKEN)
            seq.num_pending_tokens -= 1


def step(scheduler: MirroredScheduler) -> list[Row]:
    """Schedule one step, check the KV cache's books, and read its tokens back."""
    waiting = set(scheduler.waiting)
    scheduled = schedule(scheduler)
    out, seqs = scheduled
    check_books(scheduler, out)
    # The sequences admitted from the waiting queue end the batch, and num_admitted counts them.
    admitted = [seq in waiting for seq in seqs]
    assert admitted == [False] * (len(seqs) - out.num_admitted) + [True] * out.num_admitted
    read_back(scheduled)
    return rows(scheduled)


def check_books(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants after any schedule(): the budget and max_num_seqs hold; running sequences
    hold blocks for every computed token, waiting ones hold none; ref counts add up."""
    kv = scheduler.kv_cache_manager
    assert sum(out.num_new_tokens) <= scheduler.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert all(n > 0 for n in out.num_new_tokens)
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * kv.block_size >= seq.num_computed_tokens > 0
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    held: dict[int, int] = {}
    for seq in scheduler.running:
        for block in seq.block_table:
            held[block] = held.get(block, 0) + 1
    assert all(kv.ref_counts[block] == count for block, count in held.items())
    assert kv.num_free_blocks == kv.num_blocks - len(held)


# --- the token budget -------------------------------------------------------------------------


def test_long_prompt_is_chunked_to_the_token_budget(model_dir: str) -> None:
    """A prompt longer than max_num_batched_tokens is computed in budget-sized chunks, and
    only the last chunk samples; a later prompt gets what the first leaves of the budget."""
    scheduler = make_scheduler(model_dir, num_blocks=32, max_num_batched_tokens=10)
    scheduler.add(make_seq("A", 25))
    scheduler.add(make_seq("B", 6))
    assert step(scheduler) == [("A", 0, 10, False)]
    assert step(scheduler) == [("A", 10, 10, False)]
    assert step(scheduler) == [("A", 20, 5, True), ("B", 0, 5, False)]
    assert step(scheduler) == [("A", 25, 1, True), ("B", 5, 1, True)]
    assert step(scheduler) == [("A", 26, 1, True), ("B", 6, 1, True)]
    seq_a = scheduler.running[0]
    assert seq_a.output_token_ids == [SAMPLED_TOKEN] * 3  # one token per sampling step, none from chunks


def test_decodes_fill_the_budget_before_any_prompt(model_dir: str) -> None:
    """When the running decodes use the whole budget, a waiting prompt gets nothing that
    step (it is not squeezed in past max_num_batched_tokens); it starts once there is room."""
    scheduler = make_scheduler(model_dir, num_blocks=32, max_num_batched_tokens=3)
    for name in "ABC":
        scheduler.add(make_seq(name, 1))
    assert step(scheduler) == [("A", 0, 1, True), ("B", 0, 1, True), ("C", 0, 1, True)]
    scheduler.add(make_seq("D", 3))
    assert step(scheduler) == [("A", 1, 1, True), ("B", 1, 1, True), ("C", 1, 1, True)]
    assert [seq.request_id for seq in scheduler.waiting] == ["D"]
    scheduler.finish(scheduler.running[1], "stop")
    assert step(scheduler) == [("A", 2, 1, True), ("C", 2, 1, True), ("D", 0, 1, False)]


# --- max_num_seqs and FCFS --------------------------------------------------------------------


def test_max_num_seqs_caps_running_sequences(model_dir: str) -> None:
    """No more than max_num_seqs sequences run at once, however much budget is left; a
    finished one makes room for the next waiting one."""
    scheduler = make_scheduler(model_dir, num_blocks=32, max_num_batched_tokens=64, max_num_seqs=2)
    for name in "ABC":
        scheduler.add(make_seq(name, 3))
    assert step(scheduler) == [("A", 0, 3, True), ("B", 0, 3, True)]
    assert step(scheduler) == [("A", 3, 1, True), ("B", 3, 1, True)]
    assert [seq.request_id for seq in scheduler.waiting] == ["C"]
    scheduler.finish(scheduler.running[0], "stop")
    assert step(scheduler) == [("B", 4, 1, True), ("C", 0, 3, True)]


def test_running_decodes_come_before_waiting_prompts(model_dir: str) -> None:
    """Running sequences are scheduled first (decodes before any new prompt), then waiting
    prompts in arrival order, chunked to what the budget has left."""
    scheduler = make_scheduler(model_dir, num_blocks=32, max_num_batched_tokens=8)
    scheduler.add(make_seq("A", 5))
    scheduler.add(make_seq("B", 2))
    assert step(scheduler) == [("A", 0, 5, True), ("B", 0, 2, True)]
    scheduler.add(make_seq("C", 20))
    scheduler.add(make_seq("D", 2))
    # C arrived first, so it gets the 6 tokens the decodes leave; D waits behind it.
    assert step(scheduler) == [("A", 5, 1, True), ("B", 2, 1, True), ("C", 0, 6, False)]
    # Then C (now running) continues before D is considered.
    assert step(scheduler) == [("A", 6, 1, True), ("B", 3, 1, True), ("C", 6, 6, False)]
    assert step(scheduler) == [("A", 7, 1, True), ("B", 4, 1, True), ("C", 12, 6, False)]
    assert step(scheduler) == [("A", 8, 1, True), ("B", 5, 1, True), ("C", 18, 2, True), ("D", 0, 2, True)]


def test_waiting_prompt_that_does_not_fit_blocks_those_behind_it(model_dir: str) -> None:
    """FCFS is strict: when the head of the waiting queue does not fit in the free blocks, a
    smaller prompt behind it is not admitted ahead of it."""
    scheduler = make_scheduler(model_dir, num_blocks=6, max_num_batched_tokens=64)
    scheduler.add(make_seq("A", 12))  # 3 blocks, and a 4th for its first decode
    assert step(scheduler) == [("A", 0, 12, True)]
    scheduler.add(make_seq("B", 9))  # 3 blocks: only 2 are left after A's decode
    scheduler.add(make_seq("C", 3))  # 1 block: would fit
    assert step(scheduler) == [("A", 12, 1, True)]
    assert [seq.request_id for seq in scheduler.waiting] == ["B", "C"]
    assert scheduler.kv_cache_manager.num_free_blocks == 2


def test_sequence_at_its_length_limit_is_not_scheduled(model_dir: str) -> None:
    """A sequence whose pending token is its last (max_tokens) gets no further step: the
    engine finishes it when the token is read back."""
    scheduler = make_scheduler(model_dir, num_blocks=32, max_num_batched_tokens=64)
    scheduler.add(make_seq("A", 4, max_tokens=2))
    scheduler.add(make_seq("B", 4, max_tokens=8))
    assert rows(schedule(scheduler)) == [("A", 0, 4, True), ("B", 0, 4, True)]
    assert rows(schedule(scheduler)) == [("A", 4, 1, True), ("B", 4, 1, True)]  # tokens 1 pending
    # A now has 2 outputs (pending): max_tokens reached before either is read back.
    assert rows(schedule(scheduler)) == [("B", 5, 1, True)]


# --- preemption -------------------------------------------------------------------------------


def test_preemption_takes_the_most_recently_admitted_sequence(model_dir: str) -> None:
    """When an older sequence needs a block and none is free, the NEWEST running sequence is
    preempted: its blocks are freed, it goes back to the HEAD of the waiting queue (ahead of
    sequences that never ran) and num_preemptions counts it."""
    scheduler = make_scheduler(model_dir, num_blocks=5, max_num_batched_tokens=16, max_num_seqs=3)
    scheduler.add(make_seq("A", 8))  # 2 blocks; its first decode needs a 3rd
    scheduler.add(make_seq("B", 3))  # 1 block; its second decode needs a 2nd
    scheduler.add(make_seq("C", 3))  # 1 block
    scheduler.add(make_seq("D", 2))  # waits: max_num_seqs
    assert step(scheduler) == [("A", 0, 8, True), ("B", 0, 3, True), ("C", 0, 3, True)]
    assert step(scheduler) == [("A", 8, 1, True), ("B", 3, 1, True), ("C", 3, 1, True)]  # A took the last block
    seq_c = scheduler.running[2]
    assert len(seq_c.block_table) == 1 and scheduler.kv_cache_manager.num_free_blocks == 0
    # B needs a block: C, the newest, goes; A, the oldest, is untouched.
    assert step(scheduler) == [("A", 9, 1, True), ("B", 4, 1, True)]
    assert scheduler.num_preemptions == 1
    assert [seq.request_id for seq in scheduler.running] == ["A", "B"]
    assert [seq.request_id for seq in scheduler.waiting] == ["C", "D"]
    assert seq_c.status is SequenceStatus.WAITING
    assert seq_c.block_table == [] and seq_c.num_computed_tokens == 0
    assert seq_c.output_token_ids == [SAMPLED_TOKEN] * 2  # its generated tokens are kept...
    scheduler.finish(scheduler.running[0], "stop")
    scheduler.finish(scheduler.running[0], "stop")
    # ... and recomputed with its prompt when it is admitted again, first.
    assert step(scheduler) == [("C", 0, 5, True), ("D", 0, 2, True)]
    assert seq_c.num_computed_tokens == 5


def test_sequence_preempts_itself_when_it_is_the_newest(model_dir: str) -> None:
    """The newest running sequence that needs a block when none is free preempts itself (no
    older sequence is touched), and the step goes on without it."""
    scheduler = make_scheduler(model_dir, num_blocks=4, max_num_batched_tokens=6)
    scheduler.add(make_seq("A", 4))
    scheduler.add(make_seq("B", 8))
    assert step(scheduler) == [("A", 0, 4, True), ("B", 0, 2, False)]
    assert step(scheduler) == [("A", 4, 1, True), ("B", 2, 5, False)]
    assert step(scheduler) == [("A", 5, 1, True), ("B", 7, 1, True)]
    seq_a, seq_b = scheduler.running
    blocks_a = list(seq_a.block_table)
    # B's first decode needs a 3rd block; the cache is full and B is the newest.
    assert step(scheduler) == [("A", 6, 1, True)]
    assert scheduler.num_preemptions == 1
    assert scheduler.running == [seq_a] and list(scheduler.waiting) == [seq_b]
    assert seq_a.block_table == blocks_a
    assert seq_b.block_table == [] and seq_b.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.num_free_blocks == 2


def test_no_waiting_sequence_is_admitted_in_a_step_that_preempted(model_dir: str) -> None:
    """After a preemption the step admits nobody, even a waiting sequence that would fit in
    the blocks and budget left; the next step does."""
    scheduler = make_scheduler(model_dir, num_blocks=6, max_num_batched_tokens=4)
    for name, length in (("A", 4), ("B", 4), ("C", 8)):
        scheduler.add(make_seq(name, length))
    for _ in range(5):
        step(scheduler)
    assert scheduler.num_preemptions == 0 and scheduler.kv_cache_manager.num_free_blocks == 0
    seq_c = scheduler.running[2]
    assert seq_c.num_computed_tokens == 6  # mid-prompt, holding 2 blocks
    # A's decode crosses into a new block: C is preempted and frees 2 blocks, A takes 1.
    assert step(scheduler) == [("A", 8, 1, True), ("B", 6, 1, True)]
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [seq_c]
    # C's next chunk (the 2 tokens of budget left) would fit in the free block ...
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    # ... and the next step, which preempts nobody, admits it.
    assert step(scheduler) == [("A", 9, 1, True), ("B", 7, 1, True), ("C", 0, 2, False)]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preempted_sequences_finish_with_all_their_tokens(model_dir: str, enable_prefix_caching: bool) -> None:
    """Under sustained block pressure, with the engine's overlap (a step is read back only
    after the next one is scheduled), every sequence still reaches max_tokens with each
    token sampled exactly once, and every block comes back; with prefix caching too, the
    prompts sharing their first blocks."""
    scheduler = make_scheduler(model_dir, num_blocks=8, max_num_batched_tokens=8, max_num_seqs=4,
                               enable_prefix_caching=enable_prefix_caching)
    shared = list(range(500, 500 + BLOCK_SIZE))  # every prompt starts with this block
    seqs = [make_seq(name, shared + make_seq(name, length - BLOCK_SIZE).token_ids, max_tokens=10)
            for name, length in zip("ABCDE", (5, 9, 4, 12, 7))]
    for seq in seqs:
        scheduler.add(seq)
    in_flight: Scheduled | None = None
    for _ in range(300):
        scheduled = schedule(scheduler)
        check_books(scheduler, scheduled[0])
        if in_flight is not None:
            read_back(in_flight)
            for seq, samples in zip(in_flight[1], in_flight[0].samples):
                # As LLMEngine._check_stop: a known token that reaches max_tokens ends it,
                # wherever it is (running, or waiting after a preemption).
                if samples and not seq.is_finished and seq.length_limit_reached(MAX_MODEL_LEN, len(seq.token_ids)):
                    scheduler.finish(seq, "length")
        in_flight = scheduled
        if not scheduler.running and not scheduler.waiting:
            break
    assert all(seq.is_finished for seq in seqs)
    assert [len(seq.output_token_ids) for seq in seqs] == [10] * len(seqs)
    assert all(seq.num_pending_tokens == 0 for seq in seqs)
    assert scheduler.num_preemptions > 0
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.ref_counts)
    assert (kv.prefix_hits > 0) == enable_prefix_caching


# --- prefix caching on admission ---------------------------------------------------------------


def test_prefix_cache_hit_skips_computed_tokens(model_dir: str) -> None:
    """A prompt that shares full blocks with a finished one is admitted with those blocks
    already computed: it reuses them and only its own tail counts against the budget."""
    scheduler = make_scheduler(model_dir, num_blocks=16, max_num_batched_tokens=5, enable_prefix_caching=True)
    shared = list(range(100, 108))  # two full blocks
    seq_a = make_seq("A", shared + [1, 2])
    scheduler.add(seq_a)
    assert step(scheduler) == [("A", 0, 5, False)]
    assert step(scheduler) == [("A", 5, 5, True)]
    blocks_a = list(seq_a.block_table)
    scheduler.finish(seq_a, "stop")
    seq_b = make_seq("B", shared + [3, 4, 5])
    scheduler.add(seq_b)
    # 8 of B's 11 tokens are cached: its 3 new ones fit the budget of 5 in one step, and it samples.
    assert step(scheduler) == [("B", 8, 3, True)]
    assert seq_b.num_cached_tokens == 8
    assert seq_b.block_table[:2] == blocks_a[:2]
    kv = scheduler.kv_cache_manager
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 11, 8)


def test_prefix_cache_hit_within_one_step(model_dir: str) -> None:
    """A prompt admitted in the same step as an identical one already hits its blocks
    (registered when scheduled); the last token is always computed, so a block-multiple
    prompt reuses all but its last block."""
    scheduler = make_scheduler(model_dir, num_blocks=16, max_num_batched_tokens=64, enable_prefix_caching=True)
    prompt = list(range(200, 212))  # three full blocks
    seq_a, seq_b = make_seq("A", prompt), make_seq("B", prompt)
    scheduler.add(seq_a)
    scheduler.add(seq_b)
    assert step(scheduler) == [("A", 0, 12, True), ("B", 8, 4, True)]
    assert (seq_a.num_cached_tokens, seq_b.num_cached_tokens) == (0, 8)
    assert seq_b.block_table[:2] == seq_a.block_table[:2]
    assert seq_b.block_table[2] != seq_a.block_table[2]
    assert scheduler.kv_cache_manager.ref_counts[seq_a.block_table[0]] == 2


def test_preempted_sequence_is_readmitted_from_its_own_cached_blocks(model_dir: str) -> None:
    """With prefix caching, a preempted sequence's full blocks stay cached; readmitted, it
    reuses them and recomputes only the rest. num_cached_tokens keeps what its FIRST
    admission found (none here), not the hit of its recomputation."""
    scheduler = make_scheduler(model_dir, num_blocks=5, max_num_batched_tokens=32, enable_prefix_caching=True)
    seq_a, seq_b = make_seq("A", 8), make_seq("B", 9)  # 2 blocks + 3 blocks: the cache is full
    scheduler.add(seq_a)
    scheduler.add(seq_b)
    assert step(scheduler) == [("A", 0, 8, True), ("B", 0, 9, True)]
    full_blocks_b = seq_b.block_table[:2]
    assert step(scheduler) == [("A", 8, 1, True)]  # A's decode needs a block: B is preempted
    assert list(scheduler.waiting) == [seq_b] and scheduler.num_preemptions == 1
    scheduler.finish(seq_a, "stop")
    # B: 9 prompt tokens + 1 generated; its two full prompt blocks are hits.
    assert step(scheduler) == [("B", 8, 2, True)]
    assert seq_b.block_table[:2] == full_blocks_b
    assert seq_b.num_cached_tokens == 0


def test_prefix_caching_off_computes_every_token(model_dir: str) -> None:
    """The same two prompts without prefix caching: nothing is skipped (guards the test
    above against passing for the wrong reason)."""
    scheduler = make_scheduler(model_dir, num_blocks=16, max_num_batched_tokens=64)
    prompt = list(range(200, 212))
    scheduler.add(make_seq("A", prompt))
    scheduler.add(make_seq("B", prompt))
    assert step(scheduler) == [("A", 0, 12, True), ("B", 0, 12, True)]


# --- what the runner is told ------------------------------------------------------------------


def test_scheduler_output_sends_the_runner_only_what_changed(model_dir: str) -> None:
    """A sequence's prompt and blocks go to the runner the first time it is scheduled; then
    only blocks it gains, none for a decode inside its last block; after a preemption its
    new table, whole; and its id once it finishes. A request aborted before it ever ran is
    not the runner's business."""
    scheduler = make_scheduler(model_dir, num_blocks=5, max_num_batched_tokens=16, max_num_seqs=2)
    seq_a, seq_b, seq_c = make_seq("A", 6), make_seq("B", 5), make_seq("C", 3)
    for seq in (seq_a, seq_b, seq_c):
        scheduler.add(seq)

    def next_step() -> SchedulerOutput:
        scheduled = schedule(scheduler)
        read_back(scheduled)
        return scheduled[0]

    out = next_step()  # A on blocks 0-1, B on 2-3; C waits (max_num_seqs)
    assert [(new.seq_id, new.prompt_token_ids, new.block_ids) for new in out.new_seqs] == [
        (seq_a.seq_id, seq_a.prompt_token_ids, [0, 1]), (seq_b.seq_id, seq_b.prompt_token_ids, [2, 3])]
    assert out.block_updates == [] and out.finished_seq_ids == []
    for _ in range(2):
        out = next_step()  # decodes inside their last blocks
        assert out.seq_ids == [seq_a.seq_id, seq_b.seq_id] and out.new_seqs == [] and out.block_updates == []
    out = next_step()  # A's 9th token takes a third block
    assert out.block_updates == [(seq_a.seq_id, 2, [4])]
    out = next_step()  # B's 9th needs one too: none is free, and B is the newest: preempted
    assert out.seq_ids == [seq_a.seq_id] and scheduler.num_preemptions == 1
    scheduler.finish(seq_a, "stop")
    scheduler.finish(seq_c, "abort")  # never scheduled
    out = scheduler.schedule()  # B again, on new blocks
    assert out.seq_ids == [seq_b.seq_id] and out.new_seqs == []
    assert out.block_updates == [(seq_b.seq_id, 0, seq_b.block_table)]
    assert out.finished_seq_ids == [seq_a.seq_id]
