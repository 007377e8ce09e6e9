"""Draft tokens by suffix decoding (speculative decoding's "suffix" method, as vLLM's; the
method of SuffixDecoding, arXiv:2411.04975): the longest recent stretch of a sequence that
occurred before, in its own prompt and output or in the outputs of earlier requests, and after
it the continuation seen most often there, token by token while it stays likely enough.

What vLLM runs through Arctic Inference's suffix trees, this finds with array searches, which
count the same things: where a pattern occurs (a token's occurrences, narrowed one token back
at a time) and, after those places, how often each next token follows. A draft is as long as
the match allows (suffix_decoding_max_spec_factor tokens per matched token, at most
num_speculative_tokens) and stops where the path's probability (each token's share of the
continuations before it, multiplied) falls below suffix_decoding_min_token_prob. The sequence's
own tokens and the earlier outputs each propose a draft; the one whose tokens' probabilities
sum higher is taken.
"""

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from minivllm.config import SpeculativeConfig
from minivllm.engine.sequence import Sequence
from minivllm.engine.token_arrays import TokenArrays

# Earlier outputs are kept in segments of about this many tokens; a full segment is indexed once
# (its tokens sorted), so that finding a token's occurrences in it is a binary search.
SEGMENT_TOKENS = 1 << 16
SEPARATOR = -1  # between two outputs in a segment: no pattern or continuation crosses it
# Token comparisons per step of a pattern's match (occurrences times pattern tokens).
MATCH_COMPARISONS = 4096

# Occurrences of a pattern: (tokens, positions where an occurrence ends), over one or more arrays.
Occurrences = list[tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]
    score: float  # the sum of the tokens' probabilities: how much of the draft to expect accepted


def suffix_draft(occurrences: Occurrences, pattern: np.ndarray, max_tokens: int, max_spec_factor: float,
                 min_token_prob: float) -> Draft:
    """The draft to follow `pattern` given where its last token occurs (occurrences): the
    occurrences are narrowed to those of the longest suffix of pattern that occurs, then
    followed token by token by the most frequent next token (ties: the smallest id), each
    token's probability being its share of the occurrences that reached it (those at an
    array's end or before a separator count as continuing nowhere)."""
    occurrences = [(tokens, ends) for tokens, ends in occurrences if len(ends)]
    matched = 1 if occurrences else 0
    # Narrowed a stretch of the pattern at a time, as long as MATCH_COMPARISONS allows for the
    # occurrences left: one step for a long match among few occurrences, and no large
    # comparison among many (the first tokens narrow them fast).
    while occurrences and matched < len(pattern):
        stretch = max(MATCH_COMPARISONS // sum(len(ends) for _, ends in occurrences), 1)
        back = np.arange(matched, min(matched + stretch, len(pattern)))  # distances before the ends
        want = pattern[len(pattern) - 1 - back]
        runs = []  # per occurrence, how many tokens of the stretch it matches
        for tokens, ends in occurrences:
            starts = ends[:, None] - back
            equal = (starts >= 0) & (tokens[np.maximum(starts, 0)] == want)
            runs.append(np.where(equal.all(axis=1), len(back), equal.argmin(axis=1)))
        longest = max(int(run.max()) for run in runs)
        if not longest:
            break
        occurrences = [(tokens, ends[run == longest]) for (tokens, ends), run in zip(occurrences, runs)]
        occurrences = [(tokens, ends) for tokens, ends in occurrences if len(ends)]
        matched += longest
        if longest < len(back):
            break
    budget = min(max_tokens, math.ceil(matched * max_spec_factor - 1e-9))
    draft: list[int] = []
    score, prob = 0.0, 1.0
    if budget <= 0:
        return Draft(draft, score)
    # Per occurrence, the budget's tokens after it (SEPARATOR past its array's end); the rows
    # still followed are those whose tokens so far are the draft's.
    following = np.concatenate([_tokens_after(tokens, ends, budget) for tokens, ends in occurrences])
    for column in range(budget):
        next_tokens = following[:, column]
        candidates = next_tokens[next_tokens != SEPARATOR]
        if not len(candidates):
            break
        if (candidates == candidates[0]).all():  # (often, past a long match: no counting)
            token, count = int(candidates[0]), len(candidates)
        else:
            values, counts = np.unique(candidates, return_counts=True)
            best = int(counts.argmax())
            token, count = int(values[best]), int(counts[best])
        prob *= count / len(next_tokens)
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        following = following[next_tokens == token]
    return Draft(draft, score)


def _tokens_after(tokens: np.ndarray, ends: np.ndarray, count: int) -> np.ndarray:
    """[len(ends), count]: the count tokens after each end, SEPARATOR past the array's end."""
    at = ends[:, None] + np.arange(1, count + 1)
    return np.where(at < len(tokens), tokens[np.minimum(at, len(tokens) - 1)], SEPARATOR)


class _Segment:
    """Earlier outputs, concatenated with separators: while it fills, its tokens' positions are
    kept by token; once full, it is indexed by sorting."""

    __slots__ = ("_buffer", "_open_positions", "_order", "_sorted", "num_outputs", "tokens")

    def __init__(self) -> None:
        self._buffer = np.empty(1024, dtype=np.int64)  # grows by doubling while the segment fills
        self.tokens = self._buffer[:0]
        self._open_positions: dict[int, list[int]] | None = {}
        self.num_outputs = 0
        self._order: np.ndarray | None = None
        self._sorted: np.ndarray | None = None

    def add(self, output: list[int]) -> None:
        assert self._open_positions is not None, "a sealed segment takes no more outputs"
        start, end = len(self.tokens), len(self.tokens) + len(output) + 1
        if end > len(self._buffer):
            grown = np.empty(max(end, 2 * len(self._buffer)), dtype=np.int64)
            grown[:start] = self.tokens
            self._buffer = grown
        self._buffer[start:end - 1] = output
        self._buffer[end - 1] = SEPARATOR
        self.tokens = self._buffer[:end]
        for position, token in enumerate(output, start):
            self._open_positions.setdefault(token, []).append(position)
        self.num_outputs += 1

    def seal(self) -> None:
        """Index the full segment: its positions in the order of their tokens."""
        self.tokens = self.tokens.copy()  # (the spare capacity goes)
        self._buffer = self.tokens
        self._open_positions = None
        self._order = np.argsort(self.tokens, kind="stable")
        self._sorted = self.tokens[self._order]

    def occurrences(self, token: int) -> np.ndarray:
        if self._open_positions is not None:
            return np.array(self._open_positions.get(token, ()), dtype=np.int64)
        assert self._order is not None and self._sorted is not None
        lo, hi = np.searchsorted(self._sorted, [token, token + 1])
        return self._order[lo:hi]


class OutputCache:
    """The outputs of the last max_requests finished requests (about: a whole segment of the
    oldest goes at a time), where a token's occurrences are looked up."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._segments: deque[_Segment] = deque()
        self._num_outputs = 0

    def add(self, output: list[int]) -> None:
        if self.max_requests <= 0 or not output:
            return
        if not self._segments or len(self._segments[-1].tokens) >= SEGMENT_TOKENS:
            if self._segments:
                self._segments[-1].seal()
            self._segments.append(_Segment())
        self._segments[-1].add(output)
        self._num_outputs += 1
        while self._num_outputs - self._segments[0].num_outputs >= self.max_requests:
            self._num_outputs -= self._segments.popleft().num_outputs

    def occurrences(self, token: int) -> Occurrences:
        return [(segment.tokens, segment.occurrences(token)) for segment in self._segments]


class SuffixProposer:
    """Proposes each decoding sequence's draft from its own tokens and the earlier outputs."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.outputs = OutputCache(config.suffix_decoding_max_cached_requests)
        self._tokens = TokenArrays()

    def draft(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens to follow seq's known
        tokens (the better of its own tokens' draft and the earlier outputs'); [] when its last
        token occurred nowhere before."""
        tokens = self._tokens.get(seq)
        if not len(tokens):
            return []
        pattern = tokens[-self.max_depth:]
        last = int(tokens[-1])
        max_tokens = min(self.num_speculative_tokens, max_tokens)
        # (Its own occurrences end before the last token: that is the pattern itself.)
        own = suffix_draft([(tokens, np.flatnonzero(tokens[:-1] == last))], pattern, max_tokens,
                           self.max_spec_factor, self.min_token_prob)
        earlier = suffix_draft(self.outputs.occurrences(last), pattern, max_tokens, self.max_spec_factor,
                               self.min_token_prob)
        return (earlier if earlier.score > own.score else own).tokens

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        return list(map(self.draft, seqs, max_tokens))

    def finish(self, seq: Sequence) -> None:
        """A sequence finished: its output joins the earlier outputs."""
        self._tokens.drop(seq.seq_id)
        self.outputs.add(seq.output_token_ids)
