"""ModelRunner: owns the model and its KV cache; turns each SchedulerOutput into tensors,
runs the forward pass and samples the next tokens. Its pieces live beside it: what it
keeps of each sequence and a step's row order (persistent_batch.py), the KV cache's size
and storage (kv_cache.py), a step's host inputs (step_inputs.py), the persistent input
buffers (input_buffers.py) and the CUDA graphs (cuda_graphs.py).

Under tensor parallelism every rank has a ModelRunner on its shard. Rank 0 prepares each
step's host inputs (prepare_inputs) and ships them to the other ranks (executor/worker.py);
every rank then runs execute_model, whose collectives keep the ranks in step; only rank 0
gets logits, and samples.
"""

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.config import EngineConfig
from minivllm.distributed import broadcast_from_rank0, tp_rank, tp_size
from minivllm.engine.scheduler_output import GrammarBitmask, NewSequenceData, SchedulerOutput
from minivllm.executor.cuda_graphs import GraphShape, StepGraphs
from minivllm.executor.input_buffers import InputBuffers
from minivllm.executor.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_kv_blocks, release_kv_cache
from minivllm.executor.persistent_batch import PersistentBatch, PromptLogprobRows, SequenceState, StepRows
from minivllm.executor.step_inputs import CASCADE_MIN_SEQS, ModelInputs, StepInputs, prepare_step_inputs
from minivllm.layers.attention import AttentionBackend
from minivllm.layers.custom_op import use_triton_kernels
from minivllm.layers.fp8_linear import fp8_linear_layers
from minivllm.layers.linear import choose_small_batch_kernels
from minivllm.layers.sampler import Sampler, SamplingMetadata, apply_token_bitmask, gather_logprobs, to_device
from minivllm.loader import init_dummy_weights, load_weights
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.registry import build_model
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # imports Triton: the torch path must not
    from minivllm.attention.triton_backend import TritonAttentionBackend

logger = logging.getLogger(__name__)


# Sampling metadata kept per batch of sampled sequences: one per pattern of draft counts.
MAX_CACHED_SAMPLING_PATTERNS = 16

# Token id -> (logprob, rank) for the sampled (or prompt) token and the top-k at one position.
TokenLogprobs = dict[int, tuple[float, int]]
# Host copies of gather_logprobs' results for some positions: token ids [P, 1 + k] (the chosen
# token, then the top k), their logprobs, and the chosen token's rank [P].
LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StepHandle:
    """A launched step with results to read back: its sampled sequences, in the scheduler's
    order, and the host copies of its outputs; and the prompt logprobs it computes. Valid once
    `done` has completed (None on CPU, where everything is synchronous)."""

    seq_ids: list[int]
    states: list[SequenceState]  # collect appends each one's accepted tokens
    # Per sampled position (a row's, or with draft tokens each of its 1 + drafts): sampled
    # ids, then logprob ids, logprobs, ranks if asked; [] if none sampled.
    host: list[torch.Tensor]
    # Each sampled row's draft tokens, in the scheduler's order; [] for a step without any.
    drafts: list[list[int]]
    prompt_logprobs: PromptLogprobRows | None
    prompt_host: list[LogprobTensors]  # prompt_logprobs' positions, a slice each (execute_model)
    done: "torch.cuda.Event | None"


@dataclass(frozen=True, slots=True)
class ForwardPass:
    """A step whose forward pass is queued (launch_forward), with rows that sample or prompt
    logprobs: its rows (and their draft tokens, PreparedStep's), the sampled positions'
    logits on the device in the scheduler's order (None when no row samples), and the prompt
    logprobs it computes (StepHandle's)."""

    rows: StepRows
    drafts: list[list[int]]
    logits: torch.Tensor | None
    prompt_logprobs: PromptLogprobRows | None
    prompt_host: list[LogprobTensors]


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """A step whose inputs are written on the host (prepare_forward), not yet queued; with each
    sampled row's draft tokens (StepRows.drafts)."""

    rows: StepRows
    inputs: StepInputs
    drafts: list[list[int]]


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """A collected step: a row per sampled sequence, in the scheduler's order, with its new
    tokens (one, or with draft tokens the accepted drafts and the token after them) and their
    logprobs; and per sequence whose prompt logprobs the step computed, its id and those
    positions' logprobs, in prompt order (each position's dict holds the prompt token that
    follows it)."""

    seq_ids: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]  # None where the sequence asked for none
    num_drafts: list[int]  # per row: the draft tokens it verified
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]]


class OtherRanks(Protocol):
    """Rank 0's handle on the other ranks (executor/worker.py's Workers)."""

    def call(self, method: str, *args: object) -> None: ...


class ModelRunner:
    def __init__(self, config: EngineConfig, workers: OtherRanks | None = None) -> None:
        """workers: on rank 0 of a tensor-parallel engine, the other ranks, already started."""
        if tp_size() != config.tensor_parallel_size:
            raise ValueError(f"A tensor-parallel engine of size {tp_size()} is running in this process: "
                             "shut it down (LLM.shutdown()) before starting another engine.")
        self.config = config
        self.workers = workers
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_cache_dtype = config.kv_cache_torch_dtype  # the model's, or float8_e4m3fn
        self.block_size = config.block_size
        hf_config = config.hf_config
        torch.manual_seed(config.seed)
        # What this process held before this engine (another engine, say): not ours to count.
        self._memory_baseline = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        start = time.perf_counter()
        self.model = _build_model(config, self.device)
        with use_triton_kernels(config.kernels == "triton"):
            self.sampler = Sampler()
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model)
        self.vocab_size = hf_config.vocab_size
        # The most positions a step samples: a row's, or with draft tokens 1 + its drafts (no
        # more than the step's tokens).
        spec = config.speculative_config
        self.max_sampled_rows = config.max_num_seqs if spec is None else min(
            max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_num_seqs * (1 + spec.num_speculative_tokens))
        self.backend = self._make_attention_backend()
        logger.info("Loaded weights in %.1f s", time.perf_counter() - start)
        self.batch = PersistentBatch()  # the scheduler's sequences (rank 0)
        # Ids of the start-up steps' made-up sequences: negative, never an engine's.
        self._start_up_seq_ids = itertools.count(-1, -1)
        # The last step's sampled tokens on the device, and each sampled sequence's row there.
        self.last_sampled = torch.empty(0, dtype=torch.int64, device=self.device)
        self.last_sampled_rows: dict[int, int] = {}
        self.buffers = InputBuffers(max(config.max_num_batched_tokens, config.max_num_seqs), config.max_num_seqs,
                                    config.max_blocks_per_seq, self.device)
        # A draft model's weights and KV cache (as many blocks as this one) share the budget.
        draft_weight_bytes, draft_block_bytes = (0, 0) if config.draft_config is None else model_footprint(
            config.draft_config)
        self.num_blocks = num_kv_blocks(
            config,
            kv_bytes_per_block(self.model.attention_layers(), self.kv_cache_dtype, self.block_size)
            + draft_block_bytes,
            self.device, lambda: max(self._profile_free_gpu_memory() - draft_weight_bytes, 0))
        self._allocate_kv_cache(self.num_blocks)
        self._sampled_host = [torch.zeros(self.max_sampled_rows, dtype=torch.int64,
                                          pin_memory=self.device.type == "cuda") for _ in range(2)]
        self._token_buffer = 0
        # The last step's sampled sequences (ids) and their metadata while it can be reused, per
        # pattern of draft tokens (each row's count; () for a step without any).
        self._sampling_cache: tuple[list[int], dict[tuple[int, ...], SamplingMetadata]] = ([], {})
        self.graphs: StepGraphs | None = None
        if self.device.type == "cuda":
            self._compile_and_capture()

    def release_graphs(self) -> None:
        """Free the CUDA graphs; before the process group is destroyed (StepGraphs.release).
        Steps run eagerly afterwards."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    # --- set-up -----------------------------------------------------------------------------

    def _compile_and_capture(self) -> None:
        """Pick each linear layer's small-batch kernel, compile what steps will launch and
        capture the CUDA graphs now, at start-up: a kernel compiled inside a step stalls it
        for about a second. The largest step runs once first, so that the memory its
        activations take stays in PyTorch's cache (profiling emptied it): otherwise the first
        big prompt step of a run waits for cudaMalloc."""
        config = self.config
        self._run_step_and_sampler(self._largest_step(self.num_blocks))
        self._warm_up_logits()
        if config.kernels == "triton":
            choose_small_batch_kernels(self.model)
            if not config.enforce_eager:
                # Capturing runs every kernel a graph replays: decode and cascade at every batch
                # size, the mixed kernel in the prefill graphs.
                self.graphs = StepGraphs(self.model, self.buffers, config.max_num_seqs, config.max_model_len,
                                         config.max_num_batched_tokens)
                self.graphs.capture()
            elif config.max_num_seqs >= CASCADE_MIN_SEQS:
                # Eager decode steps may take the cascade kernels: compile them here.
                attn = self.model.attention_layers()[0]
                backend = cast("TritonAttentionBackend", self.backend)  # kernels == "triton"
                backend.warm_up_shared_prefix((attn.num_heads, attn.head_dim), self.dtype, attn.k_cache,
                                              attn.v_cache, config.max_num_seqs)
            if tp_rank() == 0:  # rank 0 samples, with the Triton kernels
                from minivllm.kernels import sampling  # needs a GPU
                sampling.warm_up(self.vocab_size, self.dtype, self.device)

    def _make_attention_backend(self) -> AttentionBackend:
        if self.config.kernels == "triton":
            from minivllm.attention.triton_backend import TritonAttentionBackend  # needs a GPU
            attn = self.model.attention_layers()[0]
            return TritonAttentionBackend(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                          self.config.max_num_seqs, device=self.device)
        return TorchAttentionBackend()

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step on a throwaway cache; the KV cache gets what is left of
        gpu_memory_utilization of the device."""
        config = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step = self._largest_step()
        self._allocate_kv_cache(sum(len(new.block_ids) for new in step.new_seqs))
        self._run_step_and_sampler(step)
        torch.cuda.synchronize()
        # Weights and the step's working set; the throwaway cache is not part of it.
        peak = (torch.cuda.max_memory_allocated() - self._memory_baseline
                - self.kv_cache.numel() * self.kv_cache.element_size())
        self._free_kv_cache()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # As vLLM: this engine may use gpu_memory_utilization of the device in all; and no
        # more than is actually free.
        budget = min(int(total * config.gpu_memory_utilization) - peak, free - (total - free) // 100)
        logger.info("Profiled peak %.2f GiB; %.2f GiB left for the KV cache", peak / 2**30, budget / 2**30)
        return max(budget, 0)

    def _largest_step(self, num_cache_blocks: int | None = None) -> SchedulerOutput:
        """The step with the most activations: max_num_batched_tokens prompt tokens in as few
        sequences as max_model_len allows (no step holds more than max_num_seqs sequences of
        at most max_model_len tokens), on blocks 0, 1, ...; wrapped around a cache of
        num_cache_blocks if given (the keys and values it writes are garbage in blocks no
        sequence holds yet). Its sequences are new to the runner; nothing samples."""
        config = self.config
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
        seq_len = min(config.max_model_len, num_tokens)
        blocks_per_seq = -(-seq_len // self.block_size)
        new_seqs, num_new_tokens = [], []
        for i in range(-(-num_tokens // seq_len)):
            blocks = range(i * blocks_per_seq, (i + 1) * blocks_per_seq)
            block_ids = [b % num_cache_blocks for b in blocks] if num_cache_blocks else list(blocks)
            new_seqs.append(NewSequenceData(next(self._start_up_seq_ids), [0] * seq_len, SamplingParams(), None,
                                            block_ids))
            num_new_tokens.append(min(seq_len, num_tokens - i * seq_len))
        num_seqs = len(new_seqs)
        return SchedulerOutput([new.seq_id for new in new_seqs], num_new_tokens, [0] * num_seqs,
                               [False] * num_seqs, new_seqs)

    @torch.inference_mode()
    def _run_step_and_sampler(self, step: SchedulerOutput) -> None:
        """A step of new sequences' forward pass, then the sampler's largest working set:
        logits for max_sampled_rows rows, softmaxed and sorted (on rank 0). Outputs are
        discarded, and the sequences forgotten."""
        self.update_states(step)
        prepared = self.prepare_inputs(self.batch.rows(step))
        self.update_states(SchedulerOutput(finished_seq_ids=step.seq_ids))
        inputs = self._upload(prepared)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self.model.compute_logits(hidden[:1].expand(self.max_sampled_rows, -1))
        if logits is not None:
            torch.softmax(logits.float(), dim=-1).sort(dim=-1)

    @torch.inference_mode()
    def _warm_up_logits(self) -> None:
        """The LM head once at every row count a step can sample (1..max_sampled_rows). It runs
        outside the CUDA graphs and cuBLAS picks its kernel by row count, while CUDA loads a
        kernel only at its first launch (lazy loading): a row count first met in a run would
        stall that step while its kernel loads."""
        rows = self.max_sampled_rows
        hidden = torch.zeros(rows, self.config.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        for num_rows in range(1, rows + 1):
            self.model.compute_logits(hidden[:num_rows])

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = allocate_kv_cache(self.model.attention_layers(), self.backend, num_blocks,
                                          self.block_size, self.kv_cache_dtype, self.device)

    def _free_kv_cache(self) -> None:
        release_kv_cache(self.model.attention_layers())
        del self.kv_cache

    # --- one step ---------------------------------------------------------------------------

    def update_states(self, out: SchedulerOutput) -> None:
        """Take in what the scheduler says changed: new sequences, block-table entries,
        finished sequences (PersistentBatch.update)."""
        self.batch.update(out)

    def replace_tokens(self, seq_id: int, start: int, token_ids: list[int]) -> None:
        """A sequence's tokens from `start` on are these (a draft model's runner: the target model
        kept other tokens than the ones it sampled); the KV cache past them is recomputed."""
        tokens = self.batch.states[seq_id].token_ids
        del tokens[start:]
        tokens += token_ids

    def prepare_inputs(self, rows: StepRows, graph: GraphShape | None = None,
                       prompt_logprobs: PromptLogprobRows | None = None) -> StepInputs:
        """Write the step into the next host buffer set (step_inputs.prepare_step_inputs)."""
        return prepare_step_inputs(rows, self.buffers.next_host(), self.block_size, self.last_sampled_rows,
                                   detect_cascade=self.config.kernels == "triton", graph=graph,
                                   prompt_logprobs=prompt_logprobs)

    def _upload(self, step: StepInputs) -> ModelInputs:
        """Queue the copies of the step's host rows to the device; the step's device inputs."""
        dev = self.buffers.upload(step.arrays)
        meta = AttentionMetadata(
            query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens,
            block_tables=dev.block_tables,
            slot_mapping=dev.slot_mapping,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            num_leading_decodes=step.num_decodes,
            query_start_loc_cpu=step.query_start_loc_cpu,
            seq_lens_cpu=step.seq_lens_cpu,
            num_shared_prefix_blocks=dev.num_shared_prefix_blocks if step.cascade else None,
        )
        inputs = ModelInputs(input_ids=dev.input_ids, positions=dev.positions, meta=meta,
                             logits_indices=dev.logits_indices)
        if len(dev.pending_dst):
            # Only rank 0 samples, so only it has the pending tokens; other ranks take its input ids.
            if tp_rank() == 0:
                # (index_copy_ and index_select: cheaper to launch than indexing's general path)
                inputs.input_ids.index_copy_(0, dev.pending_dst, self.last_sampled.index_select(0, dev.pending_src))
            broadcast_from_rank0(inputs.input_ids)
        return inputs

    @torch.inference_mode()
    def execute_model(self, step: StepInputs) -> tuple[torch.Tensor | None, list[LogprobTensors]]:
        """Run a prepared step's forward pass. On rank 0: the logits of its sampled rows (None
        when no row samples) and its prompt logprobs (_prompt_logprobs); (None, []) on other
        ranks. Every rank runs this for every step."""
        inputs = self._upload(step)
        if step.graph is not None:
            assert self.graphs is not None  # steps get a graph shape only from self.graphs
            # The graph was captured on slices of the persistent device buffers (InputBuffers),
            # which _upload has just filled: it takes no arguments.
            hidden = self.graphs.replay(step.graph, step.graph_kind)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        prompt_logprobs = [] if step.prompt_logprobs is None else self._prompt_logprobs(hidden, step.prompt_logprobs)
        if not len(inputs.logits_indices):
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[inputs.logits_indices]), prompt_logprobs

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptLogprobRows) -> list[LogprobTensors]:
        """The raw model's logprobs at the prompt positions `rows` names, as gather_logprobs
        gives them (the prompt token that follows each position, then the top candidates), in
        slices of max_num_seqs positions: the sampler's largest working set, which start-up
        profiling left memory for (a long prompt's logits at once would take gigabytes). Per
        slice, host copies, started (collect waits for them). Every rank computes the logits
        (the LM head gathers them to rank 0); other ranks return []."""
        hidden_rows, target_ids = to_device(np.stack((rows.hidden_rows, rows.target_ids)), self.device)
        num_logprobs = max(rows.num_logprobs)
        slice_rows = self.config.max_num_seqs
        host = []
        for start in range(0, len(target_ids), slice_rows):
            positions = slice(start, start + slice_rows)
            logits = self.model.compute_logits(hidden[hidden_rows[positions]])
            if logits is None:  # not rank 0
                continue
            found = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids[positions], num_logprobs)
            ids, logprobs, ranks = (tensor.to("cpu", non_blocking=True) for tensor in found)
            host.append((ids, logprobs, ranks))
        return host

    def execute_shipped(self, step: StepInputs) -> None:
        """On ranks 1..N-1: rank 0's prepared step, copied into this rank's host buffers, then run."""
        # (Written directly, not through the set's BlockTableRows: only rank 0 prepares steps.)
        buf = self.buffers.next_host().arrays
        for name, array in step.arrays.items():
            rows = getattr(buf, name)[:len(array)]
            if name == "block_tables":  # shipped only as wide as the longest table
                rows[:, array.shape[1]:] = 0
                rows = rows[:, :array.shape[1]]
            rows[...] = array
        self.execute_model(step)

    def prepare_forward(self, out: SchedulerOutput) -> PreparedStep | None:
        """A step's host half: take in the scheduler's changes (update_states) and write its
        inputs into the next host buffer set; None when it has no rows. Nothing is queued on
        the device yet, so the engine may first queue the sampling of the step before it
        (whose tokens this one reads on the device) and then this one's forward pass
        (launch_forward) right behind it."""
        self.update_states(out)
        if not out.seq_ids:
            return None
        rows = self.batch.rows(out)
        graph = (self.graphs.padded_shape(rows.num_tokens, len(rows.states), rows.num_decodes)
                 if self.graphs else None)
        step = self.prepare_inputs(rows, graph, self.batch.prompt_logprob_rows(rows))
        drafts = rows.drafts()
        if rows.sampled_ids:
            # The next step's pending tokens are this one's (launch_sampling puts them on the
            # device), at each row's first sampled position; never a row's that verified drafts:
            # the engine reads such a step back before it schedules the next.
            self.last_sampled_rows = (rows.sampled_row_of if not drafts else
                                      {seq_id: int(first) for seq_id, first, row_drafts
                                       in zip(rows.sampled_ids, rows.first_position, drafts) if not row_drafts})
        return PreparedStep(rows, step, drafts)

    @torch.inference_mode()
    def launch_forward(self, prepared: PreparedStep) -> ForwardPass | None:
        """Queue a prepared step's forward pass (on every rank); None when nothing samples and
        no prompt logprobs are computed. launch_sampling follows, once the grammar bitmask of
        its guided rows is known."""
        step = prepared.inputs
        if self.workers is not None:
            self.workers.call("execute_shipped", step)
        logits, prompt_host = self.execute_model(step)
        if not prepared.rows.sampled_ids and step.prompt_logprobs is None:
            return None
        return ForwardPass(prepared.rows, prepared.drafts, logits, step.prompt_logprobs,
                           prompt_host)

    @torch.inference_mode()
    def launch_sampling(self, forward: ForwardPass, grammar: GrammarBitmask | None = None) -> StepHandle:
        """launch's second half: queue the sampling of a forward pass's logits (those a grammar
        forbids at -inf first) and the copies of its results; don't wait for them.

        A row with draft tokens samples at each of its positions (collect keeps the drafts up
        to the first that differs from the token sampled in its place, and that token): the
        sample is the target model's token there, so where a draft matches it is accepted
        with the probability p(draft), and otherwise the token comes from p without the draft,
        renormalised: speculative sampling's rule for a draft that is a point mass, which
        keeps every position's distribution p, greedy or not."""
        rows, logits, drafts = forward.rows, forward.logits, forward.drafts
        sampled_ids = rows.sampled_ids
        host = []
        if sampled_ids:
            assert logits is not None  # rank 0, with sampled rows
            if grammar is not None:
                apply_token_bitmask(logits, grammar.bitmask, grammar.rows)
            sampled = self.sampler(logits, self._sampling_metadata(rows, drafts))
            # The next step reads these on the device, for sequences whose token is still pending
            # (at the positions prepare_forward noted).
            self.last_sampled = sampled.sampled_token_ids
            # Two pinned buffers in turn: a step's tokens are read after the next step is launched.
            self._token_buffer = 1 - self._token_buffer
            host = [self._sampled_host[self._token_buffer][:len(logits)]]
            host[0].copy_(sampled.sampled_token_ids, non_blocking=True)
            if sampled.logprobs is not None:
                host += [tensor.to("cpu", non_blocking=True)
                         for tensor in (sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_token_ranks)]
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return StepHandle(sampled_ids, rows.sampled, host, drafts, forward.prompt_logprobs, forward.prompt_host,
                          done)

    def collect(self, handle: StepHandle) -> SampledTokens:
        """Wait for a launched step: its sampled tokens (with draft tokens, the accepted ones
        and the token after them) and logprobs. Each row's tokens join its sequence's token ids
        here (the inputs of later steps, the history sampling reads)."""
        if handle.done is not None:
            handle.done.synchronize()
        sampled: list[int] = handle.host[0].tolist() if handle.host else []
        # Each row's kept positions: [start, end) of the sampled positions.
        if handle.drafts:
            spans = []
            start = 0
            for drafts in handle.drafts:
                accepted = 0
                while accepted < len(drafts) and sampled[start + accepted] == drafts[accepted]:
                    accepted += 1
                spans.append((start, start + accepted + 1))
                start += len(drafts) + 1
            token_ids = [sampled[start:end] for start, end in spans]
        else:
            token_ids = [[token] for token in sampled]
        for state, tokens in zip(handle.states, token_ids):
            state.token_ids += tokens
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(token_ids)
        if len(handle.host) > 1:
            ids, values, ranks = (tensor.tolist() for tensor in handle.host[1:])
            position_logprobs = (
                (range(start, end) for start, end in spans) if handle.drafts else ((i,) for i in range(len(sampled))))
            logprobs = [None if (k := state.params.logprobs) is None
                        else [_token_logprobs(ids[i], values[i], ranks[i], k) for i in positions]
                        for state, positions in zip(handle.states, position_logprobs)]
        prompt_logprobs = []
        if handle.prompt_logprobs is not None:
            prompt_logprobs = _prompt_logprob_dicts(handle.prompt_logprobs, handle.prompt_host)
        num_drafts = [len(drafts) for drafts in handle.drafts] if handle.drafts else [0] * len(token_ids)
        return SampledTokens(handle.seq_ids, token_ids, logprobs, num_drafts, prompt_logprobs)

    def _sampling_metadata(self, rows: StepRows, drafts: list[list[int]]) -> SamplingMetadata:
        """The sampling parameters of the sampled rows, on the device (drafts: each one's draft
        tokens, or [] for a step without any: then a row per sampled row, else one per position
        that samples, each row's first at rows.first_position). A step that samples the same
        sequences as an earlier one, in the same order (a steady decode batch), with as
        many drafts per row, reuses its metadata: a sequence's parameters never change, and what
        depends on its outputs (SamplingMetadata.reads_outputs) makes the metadata one step's
        only. Seeded rows get their keys for the output positions they sample."""
        pattern = tuple(map(len, drafts))
        cached_ids, cache = self._sampling_cache
        if cached_ids != rows.sampled_ids:
            cache = {}
            self._sampling_cache = (rows.sampled_ids, cache)
        meta = cache.get(pattern)
        if meta is None:
            meta = SamplingMetadata.build([row for state, row_drafts in zip(rows.sampled, drafts)
                                           for row in state.draft_sampling_rows(row_drafts)] if drafts else
                                          [state.sampling_row() for state in rows.sampled], self.vocab_size,
                                          self.device)
            # (A few patterns per batch: with k drafts, a row has 0..k.)
            if not meta.reads_outputs and len(cache) < MAX_CACHED_SAMPLING_PATTERNS:
                cache[pattern] = meta
        if meta.seeded is None:
            return meta
        return meta.at_output_positions(_output_positions(rows, drafts))


def _build_model(config: EngineConfig, device: torch.device) -> LlamaForCausalLM:
    """The model of config, its parameters in config's dtype on `device` (weights not loaded)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        with (torch.device(device), use_triton_kernels(config.kernels == "triton"),
              fp8_linear_layers(config.fp8_config)):
            return build_model(config.hf_config, config.max_model_len)
    finally:
        torch.set_default_dtype(default_dtype)


def model_footprint(config: EngineConfig) -> tuple[int, int]:
    """The bytes of config's model's weights (and buffers), and of one block of its KV cache:
    the model built on the meta device, which allocates nothing."""
    model = _build_model(config, torch.device("meta"))
    weight_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    return weight_bytes, kv_bytes_per_block(model.attention_layers(), config.kv_cache_torch_dtype,
                                            config.block_size)


def _output_positions(rows: StepRows, drafts: list[list[int]]) -> np.ndarray:
    """Per position the step samples (StepRows.logits_indices), the index among its sequence's
    outputs of the token it samples: a row's last input precedes its last sampled token (a row
    with drafts samples at its last known token and at each draft)."""
    num_prompt_tokens = np.array([state.num_prompt_tokens for state in rows.sampled], dtype=np.int64)
    last = (rows.num_computed_tokens + rows.num_new_tokens)[rows.sample_rows] - num_prompt_tokens
    if not drafts:
        return last
    # The row starting at first_position[r] samples last[r] - d_r, ..., last[r] (d_r drafts).
    per_row = rows.num_drafts[rows.sample_rows] + 1
    return np.repeat(last - per_row + 1 - rows.first_position, per_row) + np.arange(int(per_row.sum()))


def _token_logprobs(ids: list[int], values: list[float], chosen_rank: int, k: int) -> TokenLogprobs:
    """One position's row of gather_logprobs' results as id -> (logprob, rank): the chosen
    token (column 0) and the top k (the row may hold more: the batch's largest k). A chosen
    token among the top k takes its place there (as vLLM: its rank then counts ties before it)."""
    entries = {ids[0]: (values[0], chosen_rank)}
    for rank, (token, value) in enumerate(zip(ids[1:k + 1], values[1:k + 1]), start=1):
        entries[token] = (value, rank)
    return entries


def _prompt_logprob_dicts(rows: PromptLogprobRows, host: list[LogprobTensors]
                          ) -> list[tuple[int, list[TokenLogprobs]]]:
    """Per sequence of `rows`: its id and its positions' logprob dicts (_token_logprobs)."""
    ids, values, ranks = (torch.cat(parts).tolist() for parts in zip(*host))
    result = []
    start = 0
    for seq_id, count, k in zip(rows.seq_ids, rows.num_positions, rows.num_logprobs):
        end = start + count
        result.append((seq_id, [_token_logprobs(row_ids, row_values, rank, k) for row_ids, row_values, rank
                                in zip(ids[start:end], values[start:end], ranks[start:end])]))
        start = end
    return result
