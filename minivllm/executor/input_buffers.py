"""Persistent step-input buffers: pinned host staging arrays and their device twins.

Input preparation writes numpy views of the host arrays, then each field goes to the
device in one non-blocking copy. The device tensors never move, so CUDA graphs captured
on slices of them read each step's inputs. There are two host sets, used in turn: the
host prepares step N+1 while step N's copies may still be queued behind step N-1.
"""

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class StepFields(Generic[T]):
    """A step's inputs, one value per field: numpy views of the host buffers, tensors on
    the device, or anything else kept per field (a shape, a row count)."""

    input_ids: T
    positions: T
    slot_mapping: T  # cache slot of each new token's K/V (-1: stored nowhere)
    query_start_loc: T
    seq_lens: T
    block_tables: T
    logits_indices: T  # rows of the hidden states to sample from
    # Rows of input_ids whose token is still pending, and their rows in the last step's output.
    pending_dst: T
    pending_src: T
    # Decode steps taking cascade attention: blocks every block table starts with.
    num_shared_prefix_blocks: T

    def items(self) -> Iterator[tuple[str, T]]:
        return ((field.name, getattr(self, field.name)) for field in dataclasses.fields(self))

    def map(self, fn: Callable[[T], U]) -> "StepFields[U]":
        return StepFields(**{name: fn(value) for name, value in self.items()})


FieldSpec = tuple[tuple[int, ...], torch.dtype]  # a field's (shape, dtype) at its largest


def _field_specs(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> StepFields[FieldSpec]:
    tokens, seqs = (max_tokens,), (max_seqs,)
    return StepFields(
        input_ids=(tokens, torch.int64), positions=(tokens, torch.int64), slot_mapping=(tokens, torch.int64),
        query_start_loc=((max_seqs + 1,), torch.int32), seq_lens=(seqs, torch.int32),
        block_tables=((max_seqs, max_blocks_per_seq), torch.int32), logits_indices=(seqs, torch.int64),
        pending_dst=(seqs, torch.int64), pending_src=(seqs, torch.int64),
        num_shared_prefix_blocks=((1,), torch.int32))


class BlockTableRows:
    """One host set's block_tables rows, written row by row only where the row's sequence
    or its table changed since this set last held it: a sequence's block-table list only
    grows while it is the same list (Sequence.block_table), so a row that holds the same
    list needs just its new entries. At long contexts a full copy of every row is hundreds
    of block ids per sequence each step. Entries past a row's table are kept zero."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self._tables: list[list[int] | None] = [None] * len(rows)  # the list each row was written from
        self._lens = [0] * len(rows)  # entries written to each row (the rest of the row is 0)

    def write(self, tables: list[list[int]]) -> None:
        """Rows 0..len(tables)-1 := tables."""
        rows, held, lens = self.rows, self._tables, self._lens
        for i, table in enumerate(tables):
            n, written = len(table), lens[i]
            if held[i] is table:
                if n > written:
                    rows[i, written:n] = table[written:]
            else:
                rows[i, :n] = table
                if written > n:
                    rows[i, n:written] = 0
                held[i] = table
            lens[i] = n

    def clear(self, start: int, stop: int) -> None:
        """Rows start..stop-1 := zeros (padding rows: empty sequences)."""
        for i in range(start, stop):
            if self._lens[i]:
                self.rows[i, :self._lens[i]] = 0
            self._tables[i], self._lens[i] = None, 0


@dataclass
class HostSet:
    """One set of host buffers as the step's preparation writes it."""

    arrays: StepFields[np.ndarray]  # numpy views of the pinned tensors
    block_tables: BlockTableRows  # writes arrays.block_tables


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        specs = _field_specs(max_tokens, max_seqs, max_blocks_per_seq)
        num_sets = 2 if self.on_gpu else 1
        self._host_sets = [specs.map(lambda spec: torch.zeros(spec[0], dtype=spec[1], pin_memory=self.on_gpu))
                           for _ in range(num_sets)]
        self._host_views = [HostSet(arrays, BlockTableRows(arrays.block_tables))
                            for arrays in (host.map(torch.Tensor.numpy) for host in self._host_sets)]
        self._copied: list[torch.cuda.Event | None] = [None] * num_sets
        self._current = 0
        # On CPU the host array is the model's input: nothing to copy.
        self.device: StepFields[torch.Tensor] = (
            specs.map(lambda spec: torch.zeros(spec[0], dtype=spec[1], device=device)) if self.on_gpu
            else self._host_sets[0])

    def next_host(self) -> HostSet:
        """Switch to the other host set (once its last copies are done)."""
        self._current = (self._current + 1) % len(self._host_sets)
        copied = self._copied[self._current]
        if copied is not None:
            copied.synchronize()
        return self._host_views[self._current]

    def upload(self, used: StepFields[np.ndarray]) -> StepFields[torch.Tensor]:
        """Copy each field's first len(used.<field>) rows (whole rows) of the current host set
        to the device; returns those device slices. Then mark the host set busy until the
        copies have run."""
        host = self._host_sets[self._current]
        slices = {}
        for name, array in used.items():
            dst = getattr(self.device, name)[:len(array)]
            if self.on_gpu and len(array):
                dst.copy_(getattr(host, name)[:len(array)], non_blocking=True)
            slices[name] = dst
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._current] = event
        return StepFields(**slices)
