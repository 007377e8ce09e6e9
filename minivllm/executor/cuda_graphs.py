"""CUDA graphs of the decoder's forward, captured at start-up at bucketed sizes.

A step launches hundreds of small kernels; replaying a captured graph launches them in one
go. Each graph reads its inputs from the persistent InputBuffers, so a step only has to
fill those and replay the graph of the smallest bucket that fits it, padded. Three kinds:

- "decode": decode-only steps, by batch size;
- "cascade": decode-only steps whose sequences share a prefix (its length is read from the
  buffers), by batch size;
- "prefill": any other step of up to PREFILL_GRAPH_MAX_TOKENS tokens, by token count. Its
  attention is the mixed kernel over max_num_seqs sequences, those past the batch empty.
  Without a graph, launching a prefill's ~300 kernels from Python takes longer than the
  GPU runs them (a 1,024-token Qwen3-0.6B prefill: 13.5 ms of wall time, 3.0 of kernels);
  larger steps keep the GPU busy eagerly.
"""

import logging
import time
from typing import Literal

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.executor.input_buffers import InputBuffers
from minivllm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

GraphKind = Literal["decode", "cascade", "prefill"]
PREFILL_GRAPH_MAX_TOKENS = 2048


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
    prefill graph every sequence goes through the mixed kernel."""
    dev = buffers.device
    return AttentionMetadata(
        query_start_loc=dev["query_start_loc"][:num_seqs + 1], seq_lens=dev["seq_lens"][:num_seqs],
        block_tables=dev["block_tables"][:num_seqs], slot_mapping=dev["slot_mapping"][:num_tokens],
        max_query_len=1 if kind != "prefill" else num_tokens, max_seq_len=max_seq_len,
        num_shared_prefix_blocks=dev["num_shared_prefix_blocks"] if kind == "cascade" else None)


class StepGraphs:
    def __init__(self, model: LlamaForCausalLM, buffers: InputBuffers, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.model = model
        self.buffers = buffers
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.decode_sizes = graph_batch_sizes(max_num_seqs)
        self.prefill_sizes = prefill_graph_sizes(min(PREFILL_GRAPH_MAX_TOKENS, max_num_batched_tokens))
        self.graphs: dict[tuple[int, GraphKind], torch.cuda.CUDAGraph] = {}  # (size, kind)
        self.outputs: dict[tuple[int, GraphKind], torch.Tensor] = {}
        self.capture_seconds = 0.0  # how long capture() took (reported by the benchmarks)

    def padded_size(self, num_seqs: int, num_tokens: int) -> int | None:
        """The bucket a step runs in: for a decode-only step (num_tokens == num_seqs) the
        smallest captured batch size >= num_seqs, else the smallest prefill size >=
        num_tokens; None: too big, run eagerly."""
        sizes, size = (self.decode_sizes, num_seqs) if num_tokens == num_seqs else (self.prefill_sizes, num_tokens)
        return next((s for s in sizes if s >= size), None)

    def num_seqs(self, kind: GraphKind, size: int) -> int:
        """Sequence rows of a graph: a decode graph's batch size; every row in a prefill graph."""
        return self.max_num_seqs if kind == "prefill" else size

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Sane inputs for capture: every sequence empty, every token stored nowhere.
        for name, value in (("input_ids", 0), ("positions", 0), ("seq_lens", 0), ("block_tables", 0),
                            ("slot_mapping", -1), ("num_shared_prefix_blocks", 0), ("query_start_loc", 0)):
            self.buffers.device[name].fill_(value)
        pool = None
        keys = ([(size, "prefill") for size in self.prefill_sizes]
                + [(size, kind) for kind in ("decode", "cascade") for size in self.decode_sizes])
        # Largest first, so that smaller graphs reuse its memory.
        for size, kind in sorted(keys, key=lambda key: -key[0]):
            meta = graph_metadata(self.buffers, self.num_seqs(kind, size), size, self.max_model_len, kind)
            args = (self.buffers.device["input_ids"][:size], self.buffers.device["positions"][:size], meta)
            self.model(*args)  # warm-up: compiles kernels, allocates workspaces outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size, kind] = self.model(*args)
            pool = graph.pool()
            self.graphs[size, kind] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("Captured %d CUDA graphs (decode batches up to %d, plain and cascade attention; prefills up "
                    "to %d tokens) in %.1f s", len(self.graphs), self.decode_sizes[-1], self.prefill_sizes[-1],
                    self.capture_seconds)

    def replay(self, size: int, kind: GraphKind) -> torch.Tensor:
        """Run the graph on the inputs already in the buffers; hidden states [size, H]."""
        self.graphs[size, kind].replay()
        return self.outputs[size, kind]
