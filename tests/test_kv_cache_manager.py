"""Block manager invariants under random workloads (hypothesis), and prefix-cache rules."""

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.kv_cache_manager import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_IN_USE,
    KVCacheManager,
    chain_block_hashes,
)
from minivllm.engine.sequence import Sequence
from minivllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams())


def check_invariants(kv: KVCacheManager, live: list[Sequence]) -> None:
    used: dict[int, int] = {}
    for seq in live:
        for block_id in seq.block_table:
            used[block_id] = used.get(block_id, 0) + 1
    for block_id in range(kv.num_blocks):
        assert kv.ref_counts[block_id] >= 0
        assert kv.ref_counts[block_id] == used.get(block_id, 0)
        # Never both free and used.
        assert (block_id in kv.free_queue) == (kv.ref_counts[block_id] == 0)
    for block_hash, block_id in kv.cached_blocks.items():
        assert kv.block_hashes[block_id] == block_hash
    # The dashboard's map: held, else free with a reusable prefix, else free.
    assert list(kv.block_states()) == [
        BLOCK_IN_USE if block_id in used else BLOCK_CACHED if block_id in kv.cached_blocks.values() else BLOCK_FREE
        for block_id in range(kv.num_blocks)]


def admit(kv: KVCacheManager, seq: Sequence) -> bool:
    cached = kv.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached) * BLOCK_SIZE
    return kv.allocate(seq, num_new, cached)


# A small alphabet and shared stems make prefix hits common.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=20)
operations = st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), prompts, st.integers(0, 50)),
                      max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(4, 24))
def test_random_workload_keeps_invariants(ops: list[tuple[str, list[int], int]], num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    live: list[Sequence] = []
    for op, tokens, pick in ops:
        if op == "admit":
            seq = make_seq([1, 2, 3, 4, 5] + tokens)
            if admit(kv, seq):
                # What the cache handed out must be exactly this sequence's tokens.
                for i, block_id in enumerate(seq.block_table[:seq.num_computed_tokens // BLOCK_SIZE]):
                    assert kv.block_token_ids[block_id] == seq.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif op == "grow" and live:
            seq = live[pick % len(live)]
            seq.token_ids.append(pick % 3)
            if kv.allocate(seq, 1):
                seq.num_computed_tokens += 1
            else:
                seq.token_ids.pop()
        elif op == "free" and live:
            kv.free(live.pop(pick % len(live)))
        check_invariants(kv, live)
    for seq in live:
        kv.free(seq)
    check_invariants(kv, [])
    assert kv.num_free_blocks == num_blocks


def test_full_prompt_hit_still_computes_last_token() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(8)))  # exactly two blocks
    assert admit(kv, first)
    second = make_seq(list(range(8)))
    cached = kv.find_cached_prefix(second)
    assert len(cached) == 1  # the second block would leave nothing to compute
    assert kv.allocate(second, 8 - BLOCK_SIZE, cached)
    assert second.num_computed_tokens == BLOCK_SIZE
    assert second.block_table[0] == first.block_table[0]
    assert second.block_table[1] != first.block_table[1]


def test_freed_blocks_stay_cached_until_evicted() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(9)))
    assert admit(kv, seq)
    kv.free(seq)
    again = make_seq(list(range(9)))
    assert len(kv.find_cached_prefix(again)) == 2
    # Filling the pool with other tokens evicts them.
    other = make_seq([7] * 16)
    assert admit(kv, other)
    assert kv.find_cached_prefix(make_seq(list(range(9)))) == []


def test_hash_collision_is_not_a_hit() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(9)))
    assert admit(kv, seq)
    # Forge a collision: another sequence's first-block hash pointing at seq's block.
    impostor = make_seq([9, 9, 9, 9, 9])
    forged_hash = kv._full_block_hashes(impostor, 1)[0]
    kv.cached_blocks[forged_hash] = seq.block_table[0]
    assert kv.find_cached_prefix(impostor) == []
    # A collision past real hits: the hits before it stand, it and what follows do not.
    partly = make_seq(list(range(4)) + [9, 9, 9, 9, 9])
    kv.cached_blocks[kv._full_block_hashes(partly, 2)[1]] = seq.block_table[1]
    assert kv.find_cached_prefix(partly) == seq.block_table[:1]


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(3, BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(20)))
    assert not admit(kv, seq)
    assert seq.block_table == [] and kv.num_free_blocks == 3


def test_shared_prefix_detection() -> None:
    import numpy as np

    from minivllm.executor import step_inputs
    from minivllm.executor.step_inputs import shared_prefix_blocks

    bs = 16
    prefix = list(range(100, 100 + 20))  # 20 shared blocks = 320 tokens
    tables = np.zeros((8, 40), dtype=np.int32)
    for i in range(8):
        tables[i, :22] = prefix + [200 + 2 * i, 201 + 2 * i]
    seq_lens = np.full(8, 20 * bs + 20)
    assert shared_prefix_blocks(tables, seq_lens, bs) == 20
    # A sequence that diverges early cuts the shared prefix short (below the threshold: 0).
    tables[3, 5] = 999
    assert shared_prefix_blocks(tables, seq_lens, bs) == 0
    tables[3, 5] = prefix[5]
    # Every sequence keeps at least one token of its own: a context ending at the prefix.
    seq_lens[0] = 20 * bs
    assert shared_prefix_blocks(tables, seq_lens, bs) == 19
    # Too few sequences: not worth it.
    assert shared_prefix_blocks(tables[:step_inputs.CASCADE_MIN_SEQS - 1], seq_lens[:7], bs) == 0


def test_block_hashes_chain_the_same_in_pieces_or_at_once() -> None:
    """A sequence's hashes are extended as it grows: hashing its blocks a few at a time must
    give the chain that hashing them all at once gives (another sequence's prefix lookup
    compares against either), and a block's hash must depend on every block before it."""
    tokens = list(range(1000, 1000 + 6 * BLOCK_SIZE))
    at_once = chain_block_hashes(b"", tokens, BLOCK_SIZE)
    first = chain_block_hashes(b"", tokens[:2 * BLOCK_SIZE], BLOCK_SIZE)
    rest = chain_block_hashes(first[-1], tokens[2 * BLOCK_SIZE:], BLOCK_SIZE)
    assert first + rest == at_once and len(set(at_once)) == 6
    changed = chain_block_hashes(b"", [7] + tokens[1:], BLOCK_SIZE)
    assert all(a != b for a, b in zip(changed, at_once))


@given(st.lists(st.integers(0, 3), min_size=2, max_size=8), st.integers(0, 40), st.integers(0, 40))
@settings(max_examples=200, deadline=None)
def test_hashes_copied_from_the_last_hashed_sequence_are_its_own(divergence: list[int], common: int,
                                                                    tail: int) -> None:
    """A sequence that starts like the one hashed before it copies the hashes of the blocks
    they share; every sequence must still get exactly the chain of its own tokens, whatever
    they share (nothing, part of a block, whole blocks, all of the other)."""
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    base = list(range(100, 100 + common))
    for i, token in enumerate(divergence):  # each sequence diverges from the last at its own point
        tokens = base[:common * i // len(divergence)] + [token] * tail + base
        seq = make_seq(tokens)
        num_blocks = (len(tokens) - 1) // BLOCK_SIZE
        assert kv._full_block_hashes(seq, num_blocks) == chain_block_hashes(
            b"", tokens[:num_blocks * BLOCK_SIZE], BLOCK_SIZE)


def test_a_shared_prefix_is_hashed_once(monkeypatch) -> None:
    """Requests that share a long prefix hash only their own blocks after the first."""
    from minivllm.engine import kv_cache_manager

    hashed = []
    chain = kv_cache_manager.chain_block_hashes
    monkeypatch.setattr(kv_cache_manager, "chain_block_hashes",
                        lambda parent, tokens, bs: hashed.append(len(tokens) // bs) or chain(parent, tokens, bs))
    kv = KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prefix = list(range(1000, 1000 + 20 * BLOCK_SIZE))
    for i in range(4):
        seq = make_seq(prefix + [i] * (3 * BLOCK_SIZE))
        assert kv.find_cached_prefix(seq) == []  # nothing computed yet: no hits, only hashes
    assert hashed == [22, 2, 2, 2]  # 22 full blocks before the last token; then only the own ones


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(9)))
    assert admit(kv, seq)
    assert not kv.reset_prefix_cache()  # a sequence holds blocks: nothing changes
    kv.free(seq)
    assert len(kv.find_cached_prefix(make_seq(list(range(9))))) == 2
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(make_seq(list(range(9)))) == []
    assert list(kv.free_queue) == list(range(8))  # handed out in block order again, as a new pool
    check_invariants(kv, [])
