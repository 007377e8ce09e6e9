"""CUDA graphs of the decoder's forward for decode-only steps, at bucketed batch sizes.

A decode step launches hundreds of small kernels; replaying a captured graph launches
them in one go. Each graph reads its inputs from the persistent InputBuffers, so a step
only has to fill those and replay the graph of the smallest bucket that fits its batch.
Two graphs per bucket: plain decode attention, and cascade attention for batches whose
sequences share a prefix (its length is read from the buffers too).
"""

import logging
import time

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.executor.input_buffers import InputBuffers
from minivllm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8 (as vLLM), up to and including max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def decode_metadata(buffers: InputBuffers, batch_size: int, max_seq_len: int, cascade: bool) -> AttentionMetadata:
    """Metadata over the first batch_size rows of the buffers, one new token per sequence."""
    dev = buffers.device
    return AttentionMetadata(
        query_start_loc=dev["query_start_loc"][:batch_size + 1], seq_lens=dev["seq_lens"][:batch_size],
        block_tables=dev["block_tables"][:batch_size], slot_mapping=dev["slot_mapping"][:batch_size],
        max_query_len=1, max_seq_len=max_seq_len,
        num_shared_prefix_blocks=dev["num_shared_prefix_blocks"] if cascade else None)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, buffers: InputBuffers, max_batch: int, max_model_len: int) -> None:
        self.model = model
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, cascade)
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.capture_seconds = 0.0  # how long capture() took (reported by the benchmarks)

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured batch size >= batch_size (None: too big, run eagerly)."""
        return next((s for s in self.sizes if s >= batch_size), None)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Sane inputs for capture: every row an empty padding row, stored nowhere.
        for name, value in (("input_ids", 0), ("positions", 0), ("seq_lens", 0), ("block_tables", 0),
                            ("slot_mapping", -1), ("num_shared_prefix_blocks", 0)):
            self.buffers.device[name].fill_(value)
        self.buffers.device["query_start_loc"].copy_(
            torch.arange(self.buffers.device["query_start_loc"].numel(), dtype=torch.int32))
        pool = None
        for cascade in (False, True):
            for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
                meta = decode_metadata(self.buffers, size, self.max_model_len, cascade)
                args = (self.buffers.device["input_ids"][:size], self.buffers.device["positions"][:size], meta)
                self.model(*args)  # warm-up: compiles kernels, allocates workspaces outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size, cascade] = self.model(*args)
                pool = graph.pool()
                self.graphs[size, cascade] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("Captured %d CUDA graphs (decode batch sizes up to %d, plain and cascade attention) in %.1f s",
                    len(self.graphs), self.sizes[-1], self.capture_seconds)

    def replay(self, padded_size: int, cascade: bool) -> torch.Tensor:
        """Run the graph on the inputs already in the buffers; hidden states [padded_size, H]."""
        self.graphs[padded_size, cascade].replay()
        return self.outputs[padded_size, cascade]
