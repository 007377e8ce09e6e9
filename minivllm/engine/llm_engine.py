"""LLMEngine: requests in, outputs out, one scheduled step at a time."""

import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers import GenerationConfig, PreTrainedTokenizerBase

from minivllm.config import EngineConfig
from minivllm.engine.detokenizer import IncrementalDetokenizer, detokenize
from minivllm.engine.draft_model_proposer import DraftModelProposer
from minivllm.engine.grammar_spec import GrammarSpec
from minivllm.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.metrics import MAX_LISTED_REQUESTS, EngineSnapshot, RequestRow
from minivllm.engine.ngram_proposer import NgramProposer
from minivllm.engine.scheduler import DraftProposer, Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.structured_outputs import GuidedRows, StructuredOutputManager
from minivllm.engine.suffix_proposer import SuffixProposer
from minivllm.executor.model_runner import ForwardPass, ModelRunner, StepHandle, TokenLogprobs
from minivllm.executor.worker import Workers
from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from minivllm.reasoning import reasoning_parser_class
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.executor.ray_utils import RayWorkers

# New container objects between two young-generation collections while an engine lives
# (Python's default is 700).
GC_YOUNG_THRESHOLD = 10_000
# The threshold is the process's: the first engine raises it, the last to shut down puts
# back what the first found.
_engines_raising_gc_threshold = 0
_gc_threshold_before_engines = gc.get_threshold()
# How long a step with nothing to run but requests waiting for their grammar waits for one to
# compile before it returns (the caller loops; the engine core reads its commands in between).
COMPILE_WAIT_S = 0.02


def _raise_gc_threshold() -> None:
    global _engines_raising_gc_threshold, _gc_threshold_before_engines
    if _engines_raising_gc_threshold == 0:
        _gc_threshold_before_engines = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *_gc_threshold_before_engines[1:])
    _engines_raising_gc_threshold += 1


def _restore_gc_threshold() -> None:
    global _engines_raising_gc_threshold
    _engines_raising_gc_threshold -= 1
    if _engines_raising_gc_threshold == 0:
        gc.set_threshold(*_gc_threshold_before_engines)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    stream: bool  # outputs carry only what is new since the last one
    # For streaming: how many tokens / logprobs of each sample were already sent.
    num_sent_tokens: list[int] = field(default_factory=list)
    # With params.prompt_logprobs: those of prompt positions 1.. as they come in (the first
    # sample's prefill computes them), and whether an output carried them (a stream's first).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some are not in yet."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)


def _ends_with_stop_token(params: SamplingParams, token: int, num_outputs: int) -> bool:
    """Whether token, a sequence's num_outputs-th output, is a stop token that ends it (EOS or
    stop_token_ids, once min_tokens are out)."""
    return token in params.all_stop_token_ids and num_outputs >= params.min_tokens


def _other_ranks(config: EngineConfig) -> "Workers | RayWorkers | None":
    """Ranks 1..N-1 of a tensor-parallel engine, started: processes of this host, or Ray actors."""
    if config.tensor_parallel_size == 1:
        return None
    if config.distributed_executor_backend == "ray":
        from minivllm.executor.ray_utils import RayWorkers  # ray: an optional extra

        return RayWorkers(config)
    return Workers(config)


def _proposer(config: EngineConfig, num_blocks: int) -> DraftProposer | None:
    """Speculative decoding's draft proposer for speculative_config's method; None without it.
    num_blocks: the model's KV-cache blocks (a draft model's cache gets as many)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        return DraftModelProposer(config, num_blocks)
    return NgramProposer(spec) if spec.method == "ngram" else SuffixProposer(spec)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase | None = load_tokenizer(config)
        self.eos_token_ids = self._eos_token_ids()
        self.input_processor = InputProcessor(config, self.tokenizer)
        # Ranks 1..N-1 of a tensor-parallel engine; they build their shards alongside ours.
        self.workers = _other_ranks(config)
        try:
            self.model_runner = ModelRunner(config, self.workers)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(self.model_runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager, _proposer(config, self.model_runner.num_blocks))
        # Requests with structured outputs wait there for their grammar, then join the scheduler.
        # A reasoning model's grammar applies once its reasoning has ended.
        reasoner = (reasoning_parser_class(config.reasoning_parser)(self.tokenizer)
                    if config.reasoning_parser is not None and self.tokenizer is not None else None)
        self.structured_outputs = StructuredOutputManager(self.tokenizer, config.hf_config.vocab_size,
                                                          config.max_num_seqs, config.device.startswith("cuda"),
                                                          reasoner)
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}  # the requests' sequences, by id
        self.in_flight: StepHandle | None = None  # the launched step not yet read back
        # A step whose forward pass is queued and whose sampling waits for the grammar masks of
        # its guided rows.
        self.awaiting_masks: tuple[ForwardPass, GuidedRows] | None = None
        self.failure: BaseException | None = None  # what broke a step (the engine is then unusable)
        self._request_counter = itertools.count()
        # Tokens processed, for the progress bar's live rates.
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        # Speculative decoding's counts, as vLLM's metrics: rows that carried draft tokens, the
        # drafts, the accepted ones, and those accepted at each draft position.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        spec = config.speculative_config
        self.num_accepted_tokens_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        # As vLLM: the start-up heap (modules, tokenizer, compiled kernels: ~10^5 objects) lives
        # as long as the engine, so keep the collector off it (until shutdown). A full
        # collection then scans only what requests create, instead of pausing a step for tens
        # of milliseconds.
        gc.collect()
        gc.freeze()
        # A collection traverses every list in the generations it collects, and requests
        # bring long ones (a 2,000-token prompt is two lists of 2,000 references): at Python's
        # default threshold, admitting a few hundred such requests runs several collections
        # over them, on the host's critical path. Collect young objects less often.
        _raise_gc_threshold()
        self._raised_gc_threshold = True

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
        except OSError:  # no generation_config.json
            eos = getattr(self.config.hf_config, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- requests ---------------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    stream: bool = False, arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises ValueError (and changes nothing) on bad input."""
        self.add(self.make_request(request_id, prompt, params, stream, arrival_time))

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     stream: bool = False, arrival_time: float | None = None) -> Request:
        """Tokenize and validate a request. Raises ValueError on bad input."""
        params = params or SamplingParams()
        prompt_text, prompt_token_ids = self.input_processor.process(prompt, params)
        return self.build_request(request_id, prompt_text, prompt_token_ids, params, stream, arrival_time)

    def build_request(self, request_id: str, prompt_text: str | None, prompt_token_ids: list[int],
                      params: SamplingParams, stream: bool = False, arrival_time: float | None = None) -> Request:
        """A request from a prompt an InputProcessor already checked."""
        params.all_stop_token_ids = set(params.stop_token_ids or ()) | (
            set() if params.ignore_eos else self.eos_token_ids)
        seqs, detokenizers = [], []
        num_prompt_logprobs = params.prompt_logprobs
        if num_prompt_logprobs == -1:
            num_prompt_logprobs = self.input_processor.vocab_size
        for index in range(params.n):
            # Each sample has its own random stream, so a seeded request is batch-independent.
            seed = None if params.seed is None else params.seed + index
            # The prompt logprobs are the request's: the first sample's prefill computes them.
            seqs.append(Sequence(request_id, index, prompt_token_ids, params, seed,
                                 num_prompt_logprobs if index == 0 else None))
            # Text is needed step by step only to stream it or to find stop strings; other
            # requests are detokenized once, at the end (off the per-step path).
            incremental = stream or bool(params.stop)
            detokenizers.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                                if self.tokenizer is not None and incremental else None)
        return Request(request_id, prompt_text, prompt_token_ids, params, seqs, detokenizers,
                       RequestMetrics(arrival_time or time.time()), stream, [0] * params.n)

    def add(self, request: Request) -> None:
        """Queue a request built by make_request."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.seqs[seq.seq_id] = seq
        structured_outputs = request.params.structured_outputs
        if structured_outputs is not None:
            # Scheduled once its grammar has compiled (_admit_compiled).
            spec = GrammarSpec.of(structured_outputs, self.config.structured_outputs_config.disable_any_whitespace)
            self.structured_outputs.add(request.request_id, spec, request.seqs)
        else:
            for seq in request.seqs:
                self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        if self.structured_outputs.is_compiling(request_id):
            self._finish_unscheduled(request, "abort")  # never queued: the scheduler holds nothing of it
        else:
            for seq in request.seqs:
                self.scheduler.finish(seq, "abort")
        self._forget(request)

    def _forget(self, request: Request) -> None:
        """Drop a finished (or aborted) request."""
        del self.requests[request.request_id]
        for seq in request.seqs:
            del self.seqs[seq.seq_id]
        if request.params.structured_outputs is not None:
            self.structured_outputs.remove(request.request_id, request.seqs)

    @staticmethod
    def _finish_unscheduled(request: Request, finish_reason: str) -> None:
        """Finish the sequences of a request that never reached the scheduler (its grammar
        had not compiled)."""
        for seq in request.seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = finish_reason

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        """Counters and queue sizes (the serving metrics and tests read them); with speculative
        decoding, its counts too (spec_decode_*, the accepted tokens per draft position as
        spec_decode_num_accepted_tokens_pos<i>)."""
        kv = self.kv_cache_manager
        stats = {"prefix_cache_queries": kv.prefix_queries, "prefix_cache_hits": kv.prefix_hits,
                 "num_preemptions": self.scheduler.num_preemptions, "num_free_blocks": kv.num_free_blocks,
                 "num_blocks": kv.num_blocks, "num_running": len(self.scheduler.running),
                 # Sequences whose grammar is compiling wait too (vLLM counts them as waiting).
                 "num_waiting": len(self.scheduler.waiting) + self.structured_outputs.num_compiling_seqs}
        if self.config.speculative_config is not None:
            stats.update(spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
                         spec_decode_num_accepted_tokens=self.num_accepted_tokens)
            stats.update({f"spec_decode_num_accepted_tokens_pos{position}": count
                          for position, count in enumerate(self.num_accepted_tokens_per_pos)})
        return stats

    def snapshot(self) -> EngineSnapshot:
        """The dashboard's view of the engine: every KV block's state, the preempted count, and
        the oldest unfinished requests."""
        rows: list[RequestRow] = []
        for request in itertools.islice(self.requests.values(), MAX_LISTED_REQUESTS):
            seqs = request.seqs
            if any(seq.status == SequenceStatus.RUNNING for seq in seqs):
                state = "running"
            elif any(seq.is_preempted for seq in seqs):
                state = "preempted"
            else:
                state = "waiting"
            rows.append((request.request_id, state, len(request.prompt_token_ids),
                         sum(seq.num_output_tokens for seq in seqs), request.metrics.arrival_time))
        return EngineSnapshot(self.stats(), self.kv_cache_manager.block_states(), self.config.block_size,
                              sum(seq.is_preempted for seq in self.scheduler.waiting), len(self.requests), rows)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False (and nothing forgotten) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and hand the start-up heap back to the
        garbage collector (so that a deleted engine's cycles are freed), at its former
        threshold once no other engine lives. The engine cannot run steps afterwards."""
        self.structured_outputs.shutdown()
        if self.workers is not None:
            self.model_runner.release_graphs()  # before the process group goes
            self.workers.shutdown()
            self.workers = None
        gc.unfreeze()
        if self._raised_gc_threshold:
            _restore_gc_threshold()
            self._raised_gc_threshold = False

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the previous one while the device runs it.

        Returns outputs of the requests that finished, and of streaming requests that
        advanced. The step after a launch is scheduled before the launched step's tokens
        are read back, so the device never waits for the host's bookkeeping.

        A step that samples grammar-guided sequences samples only once the step before it is
        read back (their masks depend on those tokens): its forward pass is queued, and its
        sampling waits for the next call, which queues it with the next step's forward pass
        right behind, prepared beforehand; both run while the host reads this step back.

        A step that needs the last one's tokens (_needs_known_tokens) reads it back first, but
        builds its outputs only once it is launched itself, while the device runs it.
        """
        outputs: list[RequestOutput] = []
        if self.structured_outputs.has_compiling:
            outputs += self._admit_compiled()
        read_back: dict[str, Request] = {}
        if self.has_steps_in_flight and self._needs_known_tokens():
            if self.awaiting_masks is not None:
                self.in_flight = self._launch_masked_sampling()
            assert self.in_flight is not None
            read_back = self._read_back(self.in_flight)
            self.in_flight = None
        if self.failure is not None:
            raise RuntimeError("The engine failed in an earlier step; start a new one.") from self.failure
        scheduled = self.scheduler.schedule()
        launched = None
        try:
            # (Prepared for a step without rows too: the runner forgets finished sequences.)
            prepared = self.model_runner.prepare_forward(scheduled)
            if self.awaiting_masks is not None:
                self.in_flight = self._launch_masked_sampling()
            forward = self.model_runner.launch_forward(prepared) if prepared is not None else None
            guided_rows = self.structured_outputs.guided_rows(scheduled) if self.structured_outputs.guided else None
            if forward is not None and guided_rows is not None:
                self.awaiting_masks = (forward, guided_rows)
            elif forward is not None:
                launched = self.model_runner.launch_sampling(forward)
        except BaseException as error:
            # The scheduler already counted this step as done (computed tokens, cached block
            # hashes), so the engine's books no longer match the KV cache: stop for good.
            self.failure = error
            raise
        now = time.time()
        for seq_id in scheduled.seq_ids[len(scheduled.seq_ids) - scheduled.num_admitted:]:
            metrics = self.requests[self.seqs[seq_id].request_id].metrics
            # A preempted sequence is admitted again: its request keeps its first time.
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        # (A row with drafts is a decode: its token and its drafts.)
        num_decodes = scheduled.num_new_tokens.count(1) + sum(len(drafts) + 1
                                                              for drafts in scheduled.draft_token_ids.values())
        self.num_decode_tokens += num_decodes
        self.num_prefill_tokens += sum(scheduled.num_new_tokens) - num_decodes
        if read_back:
            outputs += self._outputs(read_back)
        if self.in_flight is not None:
            outputs += self._outputs(self._read_back(self.in_flight))
        self.in_flight = launched
        return outputs

    def _launch_masked_sampling(self) -> StepHandle:
        """Queue the sampling of the step awaiting its grammar masks, with the masks its guided
        sequences' matchers give now (the step before it read back)."""
        assert self.awaiting_masks is not None
        forward, guided_rows = self.awaiting_masks
        self.awaiting_masks = None
        try:
            return self.model_runner.launch_sampling(forward, self.structured_outputs.bitmask(guided_rows))
        except BaseException as error:
            self.failure = error
            raise

    @property
    def has_steps_in_flight(self) -> bool:
        """A launched step is still to be read back (its requests may all be gone)."""
        return self.in_flight is not None or self.awaiting_masks is not None

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar has compiled; finish those whose compile failed
        (finish_reason "error", as vLLM reports a request's internal error). With nothing else
        to run, first wait a little for a compile."""
        manager = self.structured_outputs
        if not self.has_steps_in_flight and not (self.scheduler.running or self.scheduler.waiting):
            manager.wait_for_compile(COMPILE_WAIT_S)
        outputs = []
        for request_id, error in manager.take_compiled():
            request = self.requests[request_id]
            if error is None:
                for seq in request.seqs:
                    self.scheduler.add(seq)
                continue
            self._finish_unscheduled(request, "error")
            request.metrics.finished_time = time.time()
            self._forget(request)
            outputs.append(self._make_output(request, self._final_texts(
                [(request, seq) for seq in request.seqs if request.detokenizers[seq.index] is None])))
        return outputs

    def _needs_known_tokens(self) -> bool:
        """Penalties, min_tokens and bad words of several tokens read a sequence's latest
        tokens: wait for them. So do draft tokens (speculative decoding) while the proposer
        finds some: they follow a sequence's last token, and how many tokens a step verified
        and kept decides where the next one starts. (A step with drafts is read back before
        the next is scheduled: its rows' proposals stay until then, or the sequence is gone.)
        Where it finds none, steps overlap as without speculation, each proposing from the
        tokens of the one read back."""
        if self.scheduler.has_proposals:
            return True
        return any(seq.needs_token_history and (
            seq.params.has_penalties or 0 < seq.num_output_tokens <= seq.params.min_tokens
            or (seq.num_output_tokens > 0 and seq.params.has_bad_word_prefixes)) for seq in self.scheduler.running)

    def _read_back(self, handle: StepHandle) -> dict[str, Request]:
        """Read a launched step back: its tokens join their sequences, which stop where one
        ends them, drafts settle and new ones are proposed; finished requests are dropped.
        What the next step's scheduling needs; returns the requests with outputs due
        (finished, or streams that advanced), for _outputs."""
        advanced: dict[str, Request] = {}
        now = time.time()
        sampled = self.model_runner.collect(handle)
        guided = self.structured_outputs.guided
        proposes = self.scheduler.proposer is not None
        grown: list[Sequence] = []  # sequences to propose drafts for, all at once
        for seq_id, positions in sampled.prompt_logprobs:  # before the tokens: a request may finish
            prompt_seq = self.seqs.get(seq_id)
            if prompt_seq is not None and not prompt_seq.is_finished:
                self.requests[prompt_seq.request_id].prompt_logprobs += positions
        for seq, tokens, token_logprobs, num_drafts in zip(map(self.seqs.get, sampled.seq_ids), sampled.token_ids,
                                                           sampled.logprobs, sampled.num_drafts):
            # Finished or aborted meanwhile (None: its whole request is gone): drop the tokens.
            if seq is None or seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_pending_tokens -= 1  # (a row has one pending token, however many it brings)
            request = self.requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if num_drafts:
                self._count_accepted(num_drafts, len(tokens) - 1)
            # Tokens one by one, as if each came from its own step: those past a stop are dropped.
            stopped = False
            for i, token in enumerate(tokens):
                seq.token_ids.append(token)
                if token_logprobs is not None:
                    seq.logprobs.append(token_logprobs[i])
                    seq.cumulative_logprob += token_logprobs[i][token][0]
                stopped = self._check_stop(request, seq, token)
                if not stopped and guided and seq.seq_id in guided:
                    stopped = self._advance_grammar(seq, token)
                if stopped:
                    break
            if not stopped and proposes:
                if num_drafts:
                    self.scheduler.settle_drafts(seq, num_drafts, len(tokens) - 1)
                grown.append(seq)
            # Offline requests only need their final output; streams get every delta.
            if stopped or request.stream:
                advanced[request.request_id] = request
        if grown:
            self.scheduler.propose(grown)
        for request in advanced.values():
            if request.finished:
                request.metrics.finished_time = now
                self._forget(request)
        return advanced

    def _outputs(self, advanced: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the requests a step read back advanced (_read_back)."""
        finished = [request for request in advanced.values() if request.finished]
        final_texts = self._final_texts([(request, seq) for request in finished for seq in request.seqs
                                         if request.detokenizers[seq.index] is None])
        return [self._make_output(request, final_texts) for request in advanced.values()
                # (A stream's first output carries its prompt logprobs.)
                if request.finished or (request.stream and not request.awaits_prompt_logprobs)]

    def _count_accepted(self, num_drafts: int, num_accepted: int) -> None:
        """Count a row that verified num_drafts draft tokens and accepted the first num_accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_position = self.num_accepted_tokens_per_pos
        for position in range(num_accepted):
            per_position[position] += 1

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> bool:
        """Finish seq if its newly known token ends it (stop token, length, stop string)."""
        params = seq.params
        num_known = len(seq.token_ids)
        num_outputs = num_known - seq.num_prompt_tokens
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        if _ends_with_stop_token(params, token, num_outputs):
            finish_reason = "stop"
            stop_reason = token if token in (params.stop_token_ids or ()) else None  # None: EOS
        elif seq.length_limit_reached(self.config.max_model_len, num_known):
            finish_reason = "length"
        detokenizer = request.detokenizers[seq.index]
        if detokenizer is not None and detokenizer.has_stop_strings:  # (others catch up in _make_output)
            # A stop token's own text is left out unless asked for, as in vLLM.
            stop_string = detokenizer.update([token], stop_terminated=finish_reason == "stop")
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
        if finish_reason is None:
            return False
        self.scheduler.finish(seq, finish_reason, stop_reason)
        return True

    def _advance_grammar(self, seq: Sequence, token: int) -> bool:
        """Advance seq's grammar with its new token; finish seq if that ends the grammar ("stop",
        as the stop token it was: even short of min_tokens, where the grammar allowed nothing
        else) or the grammar refuses it ("error", this sequence alone)."""
        verdict = self.structured_outputs.accept(seq, token)
        if verdict is None:
            return False
        stop_reason = token if verdict == "stop" and token in (seq.params.stop_token_ids or ()) else None
        self.scheduler.finish(seq, verdict, stop_reason)
        return True

    def _make_output(self, request: Request, final_texts: dict[int, str]) -> RequestOutput:
        """The request's output so far; final_texts: the text of each finished sequence
        without a detokenizer of its own, by seq_id (_final_texts)."""
        completions = []
        for seq in request.seqs:
            detokenizer = request.detokenizers[seq.index]
            start = request.num_sent_tokens[seq.index] if request.stream else 0
            if request.stream:
                request.num_sent_tokens[seq.index] = len(seq.output_token_ids)  # known tokens only
            if detokenizer is not None:
                self._detokenize(seq, detokenizer)
                text = detokenizer.get_next_output_text(seq.is_finished, request.stream)
            else:
                text = final_texts[seq.seq_id]
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = self._logprob_dicts(seq.logprobs[start:])
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids[start:],
                cumulative_logprob=seq.cumulative_logprob if request.params.logprobs is not None else None,
                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs = self._prompt_logprobs(request)
            request.prompt_logprobs_sent = True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, request.metrics, request.seqs[0].num_cached_tokens, prompt_logprobs)

    @staticmethod
    def _detokenize(seq: Sequence, detokenizer: IncrementalDetokenizer) -> None:
        """Feed seq's detokenizer the tokens it lacks, one at a time as _check_stop would (a
        detokenizer without stop strings only makes text for outputs: it is fed here, once
        the next step is launched)."""
        params = seq.params
        num_outputs = detokenizer.num_output_tokens
        for token in seq.token_ids[seq.num_prompt_tokens + num_outputs:]:
            num_outputs += 1
            detokenizer.update([token], stop_terminated=_ends_with_stop_token(params, token, num_outputs))

    def _prompt_logprobs(self, request: Request) -> PromptLogprobs:
        """As vLLM's RequestOutput.prompt_logprobs: None for the first prompt token (nothing
        precedes it), then per position its token and the top candidates, decoded."""
        return [None, *self._logprob_dicts(request.prompt_logprobs)]

    def _logprob_dicts(self, positions: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        """Per position, token id -> Logprob with the token's text alone (None without a
        tokenizer); every token decoded once, in one batch."""
        texts: dict[int, str] = {}
        if self.tokenizer is not None:
            ids = list({token for position in positions for token in position})
            texts = dict(zip(ids, self.tokenizer.batch_decode([[token] for token in ids])))
        return [{token: Logprob(value, rank, texts.get(token)) for token, (value, rank) in position.items()}
                for position in positions]

    def _final_texts(self, finished: list[tuple[Request, Sequence]]) -> dict[int, str]:
        """The whole output text of each of these finished sequences (each with its request),
        by seq_id: decoded together (detokenize), one batch per skip_special_tokens setting.
        The prompt is the request's list (a sequence's prompt_token_ids would copy it)."""
        if self.tokenizer is None:
            return {seq.seq_id: "" for _, seq in finished}
        texts: dict[int, str] = {}
        for skip in {seq.params.skip_special_tokens for _, seq in finished}:
            group = [(request, seq) for request, seq in finished if seq.params.skip_special_tokens == skip]
            decoded = detokenize(self.tokenizer, [(request.prompt_token_ids, self._text_token_ids(seq))
                                                  for request, seq in group], skip)
            texts.update(zip((seq.seq_id for _, seq in group), decoded))
        return texts

    @staticmethod
    def _text_token_ids(seq: Sequence) -> list[int]:
        """The output tokens a finished sequence's text shows: as in vLLM, a stop token's
        own text is left out unless include_stop_str_in_output."""
        stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
        if stopped_by_token and not seq.params.include_stop_str_in_output:
            return seq.output_token_ids[:-1]
        return seq.output_token_ids

