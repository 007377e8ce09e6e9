"""Numpy copies of the decoding sequences' tokens, for the draft proposers' array searches:
each sequence's tokens are converted once and the copy grows with its new tokens, so a step
does not convert whole sequences again."""

import numpy as np

from minivllm.engine.sequence import Sequence


class TokenArrays:
    def __init__(self) -> None:
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def get(self, seq: Sequence) -> np.ndarray:
        """seq's known tokens, as a view of its buffer (a sequence's tokens are only appended)."""
        buffer, size = self._arrays.get(seq.seq_id, (np.empty(0, dtype=np.int64), 0))
        token_ids = seq.token_ids
        if len(token_ids) > size:
            if len(token_ids) > len(buffer):
                grown = np.empty(max(2 * len(buffer), len(token_ids) + 64), dtype=np.int64)
                grown[:size] = buffer[:size]
                buffer = grown
            buffer[size:len(token_ids)] = token_ids[size:]
            size = len(token_ids)
            self._arrays[seq.seq_id] = (buffer, size)
        return buffer[:size]

    def drop(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)
