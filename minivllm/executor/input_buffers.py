"""Persistent step-input buffers: pinned host staging arrays and their device twins.

Input preparation writes numpy views of the host arrays. Every field lives in one byte
buffer, on the host and on the device alike (the same offsets), so a step's inputs go to the
device in one non-blocking copy: from the start of the buffer to the end of the last row a
step uses, unused tails of earlier fields included (each copy is a stream operation of a
couple of microseconds ahead of the step's kernels, so one, not one per field). The fields
are laid out by size, smallest first (block_tables, usually the largest, last), so a decode
step's copy stays short. The device tensors never move, so CUDA graphs captured on slices of
them read each step's inputs. There are two host sets, used in turn: the host prepares step
N+1 while step N's copy may still be queued behind step N-1.
"""

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from minivllm.executor.persistent_batch import SequenceState

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
    logits_indices: T  # rows of the hidden states to sample from (several per row with draft tokens)
    # Rows of input_ids whose token is still pending, and their rows in the last step's output.
    pending_dst: T
    pending_src: T
    # Decode steps taking cascade attention: blocks every block table starts with.
    num_shared_prefix_blocks: T

    def items(self) -> Iterator[tuple[str, T]]:
        return ((name, getattr(self, name)) for name in _FIELD_NAMES)

    def map(self, fn: Callable[[T], U]) -> "StepFields[U]":
        return StepFields(**{name: fn(value) for name, value in self.items()})


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(StepFields))

FieldSpec = tuple[tuple[int, ...], torch.dtype]  # a field's (shape, dtype) at its largest


def _field_specs(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> StepFields[FieldSpec]:
    tokens, seqs = (max_tokens,), (max_seqs,)
    return StepFields(
        input_ids=(tokens, torch.int64), positions=(tokens, torch.int64), slot_mapping=(tokens, torch.int64),
        query_start_loc=((max_seqs + 1,), torch.int32), seq_lens=(seqs, torch.int32),
        block_tables=((max_seqs, max_blocks_per_seq), torch.int32), logits_indices=(tokens, torch.int64),
        pending_dst=(seqs, torch.int64), pending_src=(seqs, torch.int64),
        num_shared_prefix_blocks=((1,), torch.int32))


class BlockTableRows:
    """One host set's block_tables rows, written row by row only where the row's sequence
    or its table changed since this set last held it. A sequence's table changes by appends,
    except when its entries are replaced (SequenceState.block_table_epoch counts those): a row
    that holds the same sequence at the same epoch needs just the entries appended since. At
    long contexts a full copy of every row is hundreds of block ids per sequence each step.
    Entries past a row's table are kept zero."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        # The sequence (id, and epoch of its table) each row was written from, if any. Ids,
        # not the states: a stale row does not keep a finished sequence's state alive.
        self._seq_ids: list[int | None] = [None] * len(rows)
        self._epochs = [0] * len(rows)
        self._lens = [0] * len(rows)  # entries written to each row (the rest of the row is 0)

    def write(self, states: list[SequenceState]) -> int:
        """Rows 0..len(states)-1 := the states' block tables; returns the longest's length."""
        rows, held, epochs, lens = self.rows, self._seq_ids, self._epochs, self._lens
        for i, state in enumerate(states):
            table = state.block_table
            n, written = len(table), lens[i]
            if held[i] == state.seq_id and epochs[i] == state.block_table_epoch:
                if n > written:
                    rows[i, written:n] = table[written:]
            else:
                rows[i, :n] = table
                if written > n:
                    rows[i, n:written] = 0
                held[i], epochs[i] = state.seq_id, state.block_table_epoch
            lens[i] = n
        return max(lens[:len(states)])

    def clear(self, start: int, stop: int) -> None:
        """Rows start..stop-1 := zeros (padding rows: empty sequences)."""
        for i in range(start, stop):
            if self._lens[i]:
                self.rows[i, :self._lens[i]] = 0
            self._seq_ids[i], self._lens[i] = None, 0


@dataclass
class HostSet:
    """One set of host buffers as the step's preparation writes it."""

    arrays: StepFields[np.ndarray]  # numpy views of the pinned tensors
    block_tables: BlockTableRows  # writes arrays.block_tables
    # The rows of each field the last step used (used_rows' counts, and the views).
    _used: tuple[tuple[int, ...], StepFields[np.ndarray]] | None = None

    def used_rows(self, tokens: int, seqs: int, width: int, logits: int, pending: int,
                  shared: int) -> StepFields[np.ndarray]:
        """The rows a step uses of each field (views): its tokens' and its sequences' (block
        tables width entries wide), its sampled positions, pending tokens, and shared-prefix
        count (0 or 1). Those of the last step again where it used as many (a steady batch)."""
        counts = (tokens, seqs, width, logits, pending, shared)
        if self._used is None or self._used[0] != counts:
            buf = self.arrays
            self._used = (counts, StepFields(
                input_ids=buf.input_ids[:tokens], positions=buf.positions[:tokens],
                slot_mapping=buf.slot_mapping[:tokens], query_start_loc=buf.query_start_loc[:seqs + 1],
                seq_lens=buf.seq_lens[:seqs], block_tables=buf.block_tables[:seqs, :width],
                logits_indices=buf.logits_indices[:logits], pending_dst=buf.pending_dst[:pending],
                pending_src=buf.pending_src[:pending], num_shared_prefix_blocks=buf.num_shared_prefix_blocks[:shared]))
        return self._used[1]


# Field offsets in the shared byte buffer are multiples of this (any dtype's alignment, and
# the 16 bytes of a vectorised load).
_ALIGN = 64


def _nbytes(spec: FieldSpec) -> int:
    shape, dtype = spec
    return int(np.prod(shape)) * dtype.itemsize


def _layout(specs: StepFields[FieldSpec]) -> tuple[StepFields[int], int]:
    """Each field's byte offset, smallest fields first, and the buffer's size."""
    offsets, end = {}, 0
    for name, spec in sorted(specs.items(), key=lambda item: _nbytes(item[1])):
        offsets[name] = end
        end += -(-_nbytes(spec) // _ALIGN) * _ALIGN
    return StepFields(**offsets), end


def _views(buffer: torch.Tensor, specs: StepFields[FieldSpec], offsets: StepFields[int]) -> StepFields[torch.Tensor]:
    """Each field as a typed tensor over its bytes of the buffer."""
    def view(name: str, spec: FieldSpec) -> torch.Tensor:
        start = getattr(offsets, name)
        return buffer[start:start + _nbytes(spec)].view(spec[1]).view(spec[0])
    return StepFields(**{name: view(name, spec) for name, spec in specs.items()})


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        specs = _field_specs(max_tokens, max_seqs, max_blocks_per_seq)
        self._offsets, size = _layout(specs)
        num_sets = 2 if self.on_gpu else 1
        self._host_bytes = [torch.zeros(size, dtype=torch.uint8, pin_memory=self.on_gpu) for _ in range(num_sets)]
        self._host_sets = [_views(buffer, specs, self._offsets) for buffer in self._host_bytes]
        self._host_views = [HostSet(arrays, BlockTableRows(arrays.block_tables))
                            for arrays in (host.map(torch.Tensor.numpy) for host in self._host_sets)]
        self._copied: list[torch.cuda.Event | None] = [None] * num_sets
        self._current = 0
        # On CPU the host array is the model's input: nothing to copy.
        self._device_bytes = torch.zeros(size, dtype=torch.uint8, device=device) if self.on_gpu else None
        self.device: StepFields[torch.Tensor] = (
            _views(self._device_bytes, specs, self._offsets) if self._device_bytes is not None
            else self._host_sets[0])
        # The last upload's row counts per field, its device slices and the bytes it copied:
        # steady steps use the same rows again.
        self._last_upload: tuple[tuple[int, ...], StepFields[torch.Tensor], int] = ((), self.device, 0)

    def next_host(self) -> HostSet:
        """Switch to the other host set (once its last copies are done)."""
        self._current = (self._current + 1) % len(self._host_sets)
        copied = self._copied[self._current]
        if copied is not None:
            copied.synchronize()
        return self._host_views[self._current]

    def upload(self, used: StepFields[np.ndarray]) -> StepFields[torch.Tensor]:
        """Copy each field's first len(used.<field>) rows (whole rows) of the current host set
        to the device, in one copy; returns those device slices. Then mark the host set busy
        until the copy has run."""
        lengths = tuple(len(array) for _, array in used.items())
        if lengths == self._last_upload[0]:
            _, device_slices, end = self._last_upload
        else:
            slices, end = {}, 0
            for name, length in zip(_FIELD_NAMES, lengths):
                dst = getattr(self.device, name)[:length]
                if length:
                    end = max(end, getattr(self._offsets, name) + dst.numel() * dst.element_size())
                slices[name] = dst
            device_slices = StepFields(**slices)
            self._last_upload = (lengths, device_slices, end)
        if self._device_bytes is not None:  # on a GPU
            if end:
                self._device_bytes[:end].copy_(self._host_bytes[self._current][:end], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[self._current] = event
        return device_slices
