"""Draft tokens by prompt lookup (speculative decoding's "ngram" method, as vLLM's): where
the last n tokens of a sequence occurred before in its prompt or output, the tokens that
followed them there are a cheap guess at what comes next. The model then verifies the guess
in one step (several query tokens per row) and keeps what it would have generated anyway.
"""

import numpy as np

from minivllm.config import SpeculativeConfig
from minivllm.engine.sequence import Sequence
from minivllm.engine.token_arrays import TokenArrays


def find_draft(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> np.ndarray:
    """The tokens that followed the earliest occurrence of the longest suffix of `tokens` of
    min_n to max_n tokens that occurred before (the suffix itself excluded: an occurrence
    ends before the last token), at most max_tokens of them; empty when no such suffix
    occurred. Occurrences may overlap the suffix (a run of one token matches itself shifted).
    The earliest, as vLLM's: more tokens follow it (in a run, the latest is followed by one).

    One comparison over the whole sequence finds where its last token occurred; only those
    places are extended backwards, a token at a time."""
    length = len(tokens)
    if length <= min_n or max_tokens <= 0:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # occurrences of a 1-token suffix
    matched = 1
    while matched < max_n and len(ends):
        earlier = ends[ends >= matched]  # room for one more token before the occurrence
        longer = earlier[tokens[earlier - matched] == tokens[length - 1 - matched]]
        if not len(longer):
            break
        ends = longer
        matched += 1
    if matched < min_n or not len(ends):
        return tokens[:0]
    start = int(ends[0]) + 1
    return tokens[start:start + max_tokens]


class NgramProposer:
    """Proposes each decoding sequence's draft tokens (find_draft) from its tokens as an array."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._tokens = TokenArrays()

    def draft(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens to follow seq's known
        tokens; [] when its suffix occurred nowhere before."""
        return find_draft(self._tokens.get(seq), self.min_n, self.max_n,
                          min(self.num_speculative_tokens, max_tokens)).tolist()

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        return list(map(self.draft, seqs, max_tokens))

    def finish(self, seq: Sequence) -> None:
        """Drop a finished sequence's copy."""
        self._tokens.drop(seq.seq_id)
