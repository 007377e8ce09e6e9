"""KVCacheManager: fixed-size KV blocks with reference counts, a free pool and prefix caching.

Every *full* block of a sequence gets a chained hash (parent hash + its token ids). When a
sequence is admitted, the longest chain of cached blocks matching its tokens is reused.
Blocks whose last owner finished stay in the free pool with their hash and can be hit
again until they are evicted, least recently freed first. Hits are verified against the
stored token ids, so a hash collision can never produce wrong output.
"""

from array import array
from collections import OrderedDict
from typing import cast

import numpy as np
import xxhash

from minivllm.engine.sequence import Sequence

# A block's state in KVCacheManager.block_states (one byte a block).
BLOCK_FREE = 0  # free, holding nothing reusable
BLOCK_IN_USE = 1  # held by a sequence
BLOCK_CACHED = 2  # free, but holding a cached prefix block a new sequence can reuse


def chain_block_hashes(parent_hash: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of consecutive full blocks of token_ids (a multiple of block_size
    long): each block's is the hash of its parent's and its tokens as int64 bytes. The
    bytes are made in one conversion for all the blocks (per block, it costs 4x the hash)."""
    data = array("q", token_ids).tobytes()
    step = block_size * 8  # bytes per block
    hashes = []
    for offset in range(0, len(data), step):
        parent_hash = xxhash.xxh3_128_digest(parent_hash + data[offset:offset + step])
        hashes.append(parent_hash)
    return hashes


# Blocks of two sequences' tokens compared per slice when looking for their common prefix:
# few slices for a long common prefix, little copied past the point where they part.
COMPARED_BLOCKS = 16


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._empty_pool()
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def _empty_pool(self) -> None:
        """Every block free, in block order, nothing cached."""
        self.ref_counts = [0] * self.num_blocks
        # Blocks with ref count 0, in eviction order (front = evicted first).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self.block_hashes: list[bytes | None] = [None] * self.num_blocks
        self.block_token_ids: list[list[int] | None] = [None] * self.num_blocks
        self.cached_blocks: dict[bytes, int] = {}
        # The sequence whose block hashes were chained last. Requests that arrive together
        # often share a prefix (a system prompt, a document): each copies the hashes of the
        # blocks it has in common with this one instead of hashing them again.
        self._last_hashed: Sequence | None = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache): only while no sequence holds
        one; False, changing nothing, otherwise. The pool is then as new, its blocks handed
        out in block order again (so a benchmark's next run gets the pages its first run got)."""
        if self.num_free_blocks < self.num_blocks:
            return False
        self._empty_pool()
        return True

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def block_states(self) -> bytes:
        """Each block's state, one byte a block: BLOCK_FREE, BLOCK_IN_USE or BLOCK_CACHED (the
        dashboard's map). Built at C speed from the lists kept anyway (~15 ms for 500,000 blocks)."""
        in_use = np.frombuffer(bytearray(map(bool, self.ref_counts)), np.uint8)
        hashed = np.frombuffer(bytearray(map(bool, self.block_hashes)), np.uint8)  # None: False
        return np.where(in_use, BLOCK_IN_USE, hashed * BLOCK_CACHED).astype(np.uint8).tobytes()

    def _block_tokens(self, seq: Sequence, index: int) -> list[int]:
        """The token ids of seq's block number `index`."""
        return seq.token_ids[index * self.block_size:(index + 1) * self.block_size]

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of seq's first num_blocks full blocks (memoised on the sequence)."""
        done = len(seq.block_hashes)
        if done == 0 and self._last_hashed is not None:
            seq.block_hashes = self._common_block_hashes(self._last_hashed, seq, num_blocks)
            done = len(seq.block_hashes)
        if done < num_blocks:
            bs = self.block_size
            seq.block_hashes += chain_block_hashes(seq.block_hashes[-1] if done else b"",
                                                   seq.token_ids[done * bs:num_blocks * bs], bs)
            self._last_hashed = seq
        return seq.block_hashes[:num_blocks]

    def _common_block_hashes(self, other: Sequence, seq: Sequence, num_blocks: int) -> list[bytes]:
        """other's hashes of the leading full blocks (at most num_blocks) whose tokens seq has
        too: equal tokens, equal chained hashes. Token lists are compared at C speed, a chunk
        of blocks at a time, then block by block in the chunk where they part."""
        a, b, bs = other.token_ids, seq.token_ids, self.block_size
        limit = min(num_blocks, len(other.block_hashes)) * bs
        chunk = COMPARED_BLOCKS * bs
        shared = 0  # tokens known to be in common: whole blocks
        while shared < limit:
            end = min(shared + chunk, limit)
            if a[shared:end] != b[shared:end]:
                while a[shared:shared + bs] == b[shared:shared + bs]:  # stops inside this chunk
                    shared += bs
                break
            shared = end
        return other.block_hashes[:shared // bs]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq, always leaving one token to compute;
        none for a sequence that computes its prompt's logprobs."""
        if not self.enable_prefix_caching or seq.num_prompt_logprobs is not None:
            return []
        # The last token must be computed to produce logits, so it never comes from the cache.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        found = list(map(self.cached_blocks.get, self._full_block_hashes(seq, max_blocks)))  # None: not cached
        hits = cast("list[int]", found[:found.index(None)] if None in found else found)
        # The hits' stored tokens must be seq's (so that a hash collision cannot give wrong
        # output): checked all at once, block by block only to find where they differ.
        stored = cast("list[list[int]]", self.block_token_ids)  # a cached block's entry is never None
        hit_tokens: list[int] = []
        for block_id in hits:  # list extends: faster than itertools.chain over short lists
            hit_tokens += stored[block_id]
        if hit_tokens != seq.token_ids[:len(hit_tokens)]:
            hits = hits[:next(i for i, block_id in enumerate(hits) if stored[block_id] != self._block_tokens(seq, i))]
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] | None = None) -> bool:
        """Give seq blocks for num_new_tokens more tokens; False (and no change) if they don't fit.

        cached_prefix (from find_cached_prefix) is only used when seq holds no blocks yet.
        """
        admitting = not seq.block_table
        if not admitting and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            # The common decode case: the token fits in the last block.
            self.cache_full_blocks(seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens)
            return True
        cached_prefix = cached_prefix if admitting and cached_prefix else []
        num_computed = len(cached_prefix) * self.block_size if admitting else seq.num_computed_tokens
        blocks_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        new_blocks = blocks_needed - len(cached_prefix) - len(seq.block_table)
        # Cached blocks nobody holds sit in the free queue: taking them uses free capacity too.
        ref_counts = self.ref_counts
        revived = [ref_counts[block_id] for block_id in cached_prefix].count(0)
        if new_blocks + revived > self.num_free_blocks:
            return False
        if admitting:
            for block_id in cached_prefix:
                count = ref_counts[block_id]
                if count == 0:
                    del self.free_queue[block_id]
                ref_counts[block_id] = count + 1
            seq.block_table = list(cached_prefix)
            seq.num_computed_tokens = num_computed
            if self.enable_prefix_caching and seq.num_prompt_logprobs is None:  # (the others did not look)
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += num_computed
        if new_blocks > 0:
            seq.block_table += self._take_free_blocks(new_blocks)
        self.cache_full_blocks(seq, num_computed, num_computed + num_new_tokens)
        return True

    def _take_free_blocks(self, count: int) -> list[int]:
        """The first `count` blocks of the free queue, each forgetting what it cached, at ref
        count 1. (A prompt step takes ~1,000: one loop with its lookups hoisted.)"""
        pop, block_hashes, ref_counts = self.free_queue.popitem, self.block_hashes, self.ref_counts
        taken = []
        for _ in range(count):
            block_id, _ = pop(last=False)
            evicted_hash = block_hashes[block_id]
            if evicted_hash is not None:
                del self.cached_blocks[evicted_hash]
                block_hashes[block_id] = None
                self.block_token_ids[block_id] = None
            ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def cache_full_blocks(self, seq: Sequence, start_token: int, end_token: int) -> None:
        """Register the blocks that tokens [start_token, end_token) complete.

        This happens at scheduling time: a sequence admitted later in the same step can
        already hit them, because every layer stores the step's K/V before attending.
        A block completed by a pending token (value not yet known) is registered on the
        next call, which therefore looks one block back. (Blocks completed by accepted
        draft tokens: Scheduler.settle_drafts calls this once they are known.)
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = max(start_token - 1, 0) // bs, min(end_token, len(seq.token_ids)) // bs
        if first >= last:
            return
        hashes = self._full_block_hashes(seq, last)
        # (A prompt step registers ~1,000 blocks: the lookups hoisted out of the loop.)
        table, tokens = seq.block_table, seq.token_ids
        block_hashes, cached_blocks, block_token_ids = self.block_hashes, self.cached_blocks, self.block_token_ids
        for i in range(first, last):
            block_id, block_hash = table[i], hashes[i]
            if block_hashes[block_id] is None and block_hash not in cached_blocks:
                cached_blocks[block_hash] = block_id
                block_hashes[block_id] = block_hash
                block_token_ids[block_id] = tokens[i * bs:(i + 1) * bs]

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Its last blocks are queued for eviction first, so shared
        prefixes (the first blocks) stay cached longest."""
        ref_counts, free_queue = self.ref_counts, self.free_queue  # (a hot loop: W3 frees 36,000 blocks at once)
        for block_id in reversed(seq.block_table):
            count = ref_counts[block_id] - 1
            assert count >= 0, f"block {block_id} freed twice"
            ref_counts[block_id] = count
            if count == 0:
                free_queue[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
