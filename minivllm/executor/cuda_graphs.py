"""CUDA graphs of the decoder's forward, captured at start-up at bucketed sizes.

A step launches hundreds of small kernels; replaying a captured graph launches them in one
go. Each graph reads its inputs from the persistent InputBuffers, so a step only has to
fill those and replay the graph of the smallest bucket that fits it, padded. Three kinds:

- "decode": decode-only steps, by batch size;
- "cascade": decode-only steps whose sequences share a prefix (its length is read from the
  buffers), by batch size;
- "prefill": steps of prompt chunks (no decodes at the front, see padded_shape) of up to
  max_num_batched_tokens tokens, by token count and by sequence rows
  (PREFILL_GRAPH_FEW_SEQS, or max_num_seqs). Its attention is the mixed kernel over all
  the rows, those past the batch empty: each empty row still launches a program per KV
  head, which is why a step of a few sequences gets a graph of few rows.
  Without a graph, launching a prefill's ~300 kernels from Python can take as long as the
  GPU takes to run them, or longer for short prompts: the host would have no time left to
  prepare the next step while the device runs this one.
"""

import logging
import time
from typing import Literal, Protocol

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.executor.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

GraphKind = Literal["decode", "cascade", "prefill"]
GraphShape = tuple[int, int]  # (tokens, sequence rows) of a graph's inputs
# Steps of at most this many sequences take prefill graphs of this many rows, not
# max_num_seqs: every empty row launches a program per KV head (a binary search of dependent
# loads), scheduled ahead of the real ones; with 4 rows a single prompt's attention runs as
# fast as eagerly.
PREFILL_GRAPH_FEW_SEQS = 4


class StepForward(Protocol):
    """What a graph captures: the model's forward pass, input ids and positions [tokens] and the
    step's metadata to hidden states [tokens, H] (any model registry.build_model builds)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor: ...


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8 (as vLLM), up to and including max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Powers of two from 16, up to and including max_tokens."""
    return [1 << i for i in range(4, max_tokens.bit_length()) if 1 << i < max_tokens] + [max_tokens]


def graph_metadata(buffers: InputBuffers, num_seqs: int, num_tokens: int, max_seq_len: int,
                   kind: GraphKind) -> AttentionMetadata:
    """Metadata over the first rows of the buffers. No host copy of query_start_loc: in a
    prefill graph every sequence goes through the mixed kernel (no leading decodes)."""
    dev = buffers.device
    return AttentionMetadata(
        query_start_loc=dev.query_start_loc[:num_seqs + 1], seq_lens=dev.seq_lens[:num_seqs],
        block_tables=dev.block_tables[:num_seqs], slot_mapping=dev.slot_mapping[:num_tokens],
        max_query_len=1 if kind != "prefill" else num_tokens, max_seq_len=max_seq_len,
        num_leading_decodes=0 if kind == "prefill" else num_seqs,
        num_shared_prefix_blocks=dev.num_shared_prefix_blocks if kind == "cascade" else None)


class StepGraphs:
    def __init__(self, model: StepForward, buffers: InputBuffers, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.model = model
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.decode_sizes = graph_batch_sizes(max_num_seqs)
        self.prefill_sizes = prefill_graph_sizes(max_num_batched_tokens)
        self.prefill_rows = sorted({min(PREFILL_GRAPH_FEW_SEQS, max_num_seqs), max_num_seqs})
        self.graphs: dict[tuple[GraphShape, GraphKind], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[GraphShape, GraphKind], torch.Tensor] = {}
        self.capture_seconds = 0.0  # how long capture() took (reported by the benchmarks)

    def padded_shape(self, num_tokens: int, num_seqs: int, num_decodes: int) -> GraphShape | None:
        """The graph a step runs in (its new tokens, its rows, and how many of them lead it
        with one new token each: StepRows): for a decode-only step the smallest captured
        batch size that holds it; for a step of prompt chunks the smallest prefill token and
        row counts. None, to run eagerly: too big, or decodes at the front of a mixed step.
        Those take the split-KV decode kernel eagerly; in a prefill graph the mixed kernel
        would give each one program per KV head, streaming a long context alone."""
        if num_decodes == num_seqs:
            size = next((s for s in self.decode_sizes if s >= num_seqs), None)
            return None if size is None else (size, size)
        if num_decodes:
            return None
        tokens = next((s for s in self.prefill_sizes if s >= num_tokens), None)
        rows = next(r for r in self.prefill_rows if r >= num_seqs)
        return None if tokens is None else (tokens, rows)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Sane inputs for capture: every sequence empty, every token stored nowhere.
        dev = self.buffers.device
        for tensor in (dev.input_ids, dev.positions, dev.seq_lens, dev.block_tables, dev.num_shared_prefix_blocks,
                       dev.query_start_loc):
            tensor.zero_()
        dev.slot_mapping.fill_(-1)
        pool = None
        keys: list[tuple[tuple[int, int], GraphKind]] = (
            [((tokens, rows), "prefill") for tokens in self.prefill_sizes for rows in self.prefill_rows]
            + [((size, size), kind) for kind in ("decode", "cascade") for size in self.decode_sizes])
        # Largest first, so that smaller graphs reuse its memory.
        for (tokens, rows), kind in sorted(keys, key=lambda key: (-key[0][0], -key[0][1])):
            meta = graph_metadata(self.buffers, rows, tokens, self.max_model_len, kind)
            args = (dev.input_ids[:tokens], dev.positions[:tokens], meta)
            self.model(*args)  # warm-up: compiles kernels, allocates workspaces outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[(tokens, rows), kind] = self.model(*args)
            pool = graph.pool()
            self.graphs[(tokens, rows), kind] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("Captured %d CUDA graphs (decode batches up to %d, plain and cascade attention; prefills up "
                    "to %d tokens) in %.1f s", len(self.graphs), self.decode_sizes[-1], self.prefill_sizes[-1],
                    self.capture_seconds)

    def replay(self, shape: GraphShape, kind: GraphKind) -> torch.Tensor:
        """Run the graph on the inputs already in the buffers; hidden states [tokens, H]."""
        self.graphs[shape, kind].replay()
        return self.outputs[shape, kind]

    def release(self) -> None:
        """Destroy every captured graph and wait until the device has let go of them.

        A graph that captured an NCCL collective holds a reference on its communicator that
        only destroying the graph drops, and destroying the process group waits for those
        references: without this, a tensor-parallel engine's shutdown hangs
        (pytorch/pytorch#115388)."""
        torch.cuda.synchronize()  # no replay still running in the pool's memory
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        torch.cuda.synchronize()
