"""Persistent step-input buffers: pinned host staging arrays and their device twins.

Input preparation writes numpy views of the host arrays, then each field goes to the
device in one non-blocking copy. The device tensors never move, so CUDA graphs captured
on slices of them read each step's inputs.
"""

import numpy as np
import torch


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            "block_tables": ((max_seqs, max_blocks_per_seq), torch.int32),
            "logits_indices": ((max_seqs,), torch.int64),
        }
        self.host: dict[str, np.ndarray] = {}
        self._host_tensors: dict[str, torch.Tensor] = {}
        self.device: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in shapes.items():
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self._host_tensors[name] = host
            self.host[name] = host.numpy()
            # On CPU the host array is the model's input: nothing to copy.
            self.device[name] = torch.zeros(shape, dtype=dtype, device=device) if pin else host

    def upload(self, name: str, rows: int) -> torch.Tensor:
        """Copy the first `rows` rows of a field to the device; returns that device slice."""
        dst = self.device[name][:rows]
        if dst.data_ptr() != self._host_tensors[name].data_ptr():
            dst.copy_(self._host_tensors[name][:rows], non_blocking=True)
        return dst
