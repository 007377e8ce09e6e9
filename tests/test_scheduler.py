"""The scheduled batch's order (CPU, no model)."""

from minivllm import SamplingParams
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.sequence import Sequence


def make_batch(rows: list[tuple[int, int]]) -> ScheduledBatch:
    """A batch of (computed tokens, new tokens) rows; a row samples when its new token count is 1."""
    batch = ScheduledBatch()
    for i, (computed, new) in enumerate(rows):
        seq = Sequence(f"r{i}", 0, list(range(computed + new)), SamplingParams())
        seq.num_computed_tokens = computed
        batch.add(seq, new, samples=new == 1)
    return batch


def test_longest_decodes_first_orders_only_the_leading_decodes() -> None:
    rows = [(5, 1), (40, 1), (12, 1), (40, 1), (0, 30), (9, 1)]  # the last decode follows a chunk: stays put
    batch = make_batch(rows)
    ordered = batch.longest_decodes_first()
    assert ordered.num_computed_tokens == [40, 40, 12, 5, 0, 9]
    assert ordered.num_new_tokens == [1, 1, 1, 1, 30, 1]
    # Every column moved together, and the input batch is unchanged.
    for seq, computed, samples in zip(ordered.seqs, ordered.num_computed_tokens, ordered.samples):
        assert seq.num_computed_tokens == computed and samples == (seq.num_tokens - computed == 1)
    assert [s.request_id for s in ordered.seqs[:4]] == ["r1", "r3", "r2", "r0"]  # ties keep batch order
    assert batch.num_computed_tokens == [c for c, _ in rows]
