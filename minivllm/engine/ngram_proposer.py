"""Draft tokens by prompt lookup (speculative decoding's "ngram" method, as vLLM's): where
the last n tokens of a sequence occurred before in its prompt or output, the tokens that
followed them there are a cheap guess at what comes next. The model then verifies the guess
in one step (several query tokens per row) and keeps what it would have generated anyway.
"""

import numpy as np

from minivllm.config import SpeculativeConfig
from minivllm.engine.sequence import Sequence


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
    """Proposes each decoding sequence's draft tokens (find_draft) from a numpy copy of its
    tokens that it keeps, growing it with the sequence's new tokens: a sequence's tokens are
    converted once, not at every step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._tokens: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) draft tokens to follow seq's known
        tokens; [] when its suffix occurred nowhere before."""
        return find_draft(self._token_array(seq), self.min_n, self.max_n,
                          min(self.num_speculative_tokens, max_tokens)).tolist()

    def _token_array(self, seq: Sequence) -> np.ndarray:
        """seq's known tokens, as a view of its buffer (tokens are only ever appended)."""
        buffer, size = self._tokens.get(seq.seq_id, (np.empty(0, dtype=np.int64), 0))
        token_ids = seq.token_ids
        if len(token_ids) > size:
            if len(token_ids) > len(buffer):
                grown = np.empty(max(2 * len(buffer), len(token_ids) + 64), dtype=np.int64)
                grown[:size] = buffer[:size]
                buffer = grown
            buffer[size:len(token_ids)] = token_ids[size:]
            size = len(token_ids)
            self._tokens[seq.seq_id] = (buffer, size)
        return buffer[:size]

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's copy."""
        self._tokens.pop(seq_id, None)
