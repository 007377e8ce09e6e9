"""Persistent step-input buffers: pinned host staging arrays and their device twins.

Input preparation writes numpy views of the host arrays, then each field goes to the
device in one non-blocking copy. The device tensors never move, so CUDA graphs captured
on slices of them read each step's inputs. There are two host sets, used in turn: the
host prepares step N+1 while step N's copies may still be queued behind step N-1.
"""

import numpy as np
import torch

_FIELDS = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "query_start_loc": torch.int32,
    "seq_lens": torch.int32,
    "block_tables": torch.int32,
    "logits_indices": torch.int64,
    # Rows of input_ids whose token is still pending, and their rows in the last step's output.
    "pending_dst": torch.int64,
    "pending_src": torch.int64,
    # Decode steps taking cascade attention: blocks every block table starts with.
    "num_shared_prefix_blocks": torch.int32,
}


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        shapes = {"input_ids": (max_tokens,), "positions": (max_tokens,), "slot_mapping": (max_tokens,),
                  "query_start_loc": (max_seqs + 1,), "seq_lens": (max_seqs,),
                  "block_tables": (max_seqs, max_blocks_per_seq), "logits_indices": (max_seqs,),
                  "pending_dst": (max_seqs,), "pending_src": (max_seqs,), "num_shared_prefix_blocks": (1,)}
        num_sets = 2 if self.on_gpu else 1
        self._host_sets = [{name: torch.zeros(shape, dtype=_FIELDS[name], pin_memory=self.on_gpu)
                            for name, shape in shapes.items()} for _ in range(num_sets)]
        self._copied: list[torch.cuda.Event | None] = [None] * num_sets
        self._current = 0
        # On CPU the host array is the model's input: nothing to copy.
        self.device = {name: torch.zeros(shape, dtype=_FIELDS[name], device=device) if self.on_gpu
                       else self._host_sets[0][name] for name, shape in shapes.items()}

    def next_host(self) -> dict[str, np.ndarray]:
        """Switch to the other host set (once its last copies are done); numpy views of it."""
        self._current = (self._current + 1) % len(self._host_sets)
        copied = self._copied[self._current]
        if copied is not None:
            copied.synchronize()
        return {name: tensor.numpy() for name, tensor in self._host_sets[self._current].items()}

    def upload(self, name: str, rows: int) -> torch.Tensor:
        """Copy the first `rows` rows of a field to the device; returns that device slice."""
        dst = self.device[name][:rows]
        if self.on_gpu:
            dst.copy_(self._host_sets[self._current][name][:rows], non_blocking=True)
        return dst

    def uploads_queued(self) -> None:
        """Mark the current host set busy until the copies queued so far have run."""
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._current] = event
