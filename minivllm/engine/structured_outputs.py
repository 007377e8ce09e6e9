"""StructuredOutputManager: grammars for the requests that ask for structured outputs, and
each step's bitmask of the tokens their sequences may sample next (xgrammar).

A request's grammar compiles on a thread pool (xgrammar compiles without the interpreter lock),
once per spec (GrammarSpec, cached here and in xgrammar's compiler); the request waits here,
outside the scheduler, until it has compiled, so the step loop never waits for a compile. Then
each of its sequences gets a GrammarMatcher: the state of its output in the grammar, advanced
with every token the engine reads back. A step that samples guided sequences asks `bitmask`
for their next-token masks once the step before it is read back (LLMEngine.step).

A reasoning model writes its reasoning first, unconstrained: with a `reasoner` (an object with
vLLM's ReasoningParser method `is_reasoning_end(token_ids) -> bool`), a sequence is neither
masked nor advanced until the reasoner says the reasoning has ended (asked of the prompt, then
of each new token alone); the grammar applies to the tokens after that.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from minivllm.engine.grammar_spec import GrammarSpec
from minivllm.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from minivllm.engine.sequence import Sequence

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Compiled grammars kept by spec (xgrammar's compiler keeps its own cache besides, in bytes).
GRAMMAR_CACHE_SIZE = 128
XGRAMMAR_CACHE_BYTES = 512 * 2**20
# A step's masks are filled in one call of xgrammar's BatchGrammarMatcher: on one thread, a loop
# in C++ (cheaper than a call per matcher, from one row on); on more, xgrammar 0.2.9 starts that
# many threads anew at every call, tens of microseconds each, about what filling a few dozen rows
# takes. So a step takes a thread per ROWS_PER_FILL_THREAD rows, up to half the cores (xgrammar's
# "auto", which starts them all whatever the batch). benchmarks/kernels/grammar_bitmask.py
# --threads times both.
ROWS_PER_FILL_THREAD = 64


class ReasoningEnd(Protocol):
    """What the manager asks of a reasoning parser (vLLM's ReasoningParser has this method)."""

    def is_reasoning_end(self, token_ids: list[int]) -> bool: ...


@dataclass(slots=True)
class _Guided:
    """One sequence's place in its grammar."""

    matcher: xgr.GrammarMatcher
    reasoning_ended: bool  # until then the sequence is free text, its matcher untouched
    # The matcher's stop tokens: only one of them can end (terminate) it.
    stop_token_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class GuidedRows:
    """A step's sampled rows of guided sequences, in its order: their ids, each one's first
    position among the step's sampled positions (a row with d draft tokens samples 1 + d) and
    its drafts ([] for every row where the step has none); and how many positions it samples."""

    seq_ids: list[int]
    positions: list[int]
    drafts: list[list[int]]
    num_positions: int


@dataclass(slots=True)
class _Compiling:
    """A request waiting for its grammar."""

    seqs: list[Sequence]
    grammar: Future[xgr.CompiledGrammar]


class StructuredOutputManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, max_num_seqs: int,
                 pin_memory: bool, reasoner: ReasoningEnd | None = None) -> None:
        """vocab_size: the model's logits width; pin_memory: the bitmask is copied to a CUDA
        device. Nothing of xgrammar is loaded before the first grammar."""
        self.tokenizer = tokenizer
        # The bitmask covers the tokenizer's ids only: logits past them (a vocabulary padded for
        # the GPU's sake, up to 3x the tokenizer's where a model pairs with a smaller tokenizer)
        # are never allowed (apply_token_bitmask), and xgrammar's fill costs grow with the width.
        self.vocab_size = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        self.max_num_seqs = max_num_seqs
        self.pin_memory = pin_memory
        self.reasoner = reasoner
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Future[xgr.GrammarCompiler] | None = None
        self._grammars: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._compiling: dict[str, _Compiling] = {}  # by request id
        self.guided: dict[int, _Guided] = {}  # by seq id: the sequences whose grammar is compiled
        self._bitmask: torch.Tensor | None = None
        self._max_fill_threads = max(1, (os.cpu_count() or 2) // 2)
        self._batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}  # by thread count

    # --- requests ---------------------------------------------------------------------------

    def add(self, request_id: str, spec: GrammarSpec, seqs: list[Sequence]) -> None:
        """Hold a request's sequences until its grammar has compiled (take_compiled)."""
        self._compiling[request_id] = _Compiling(seqs, self._compile(spec))

    def _compile(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        grammar = self._grammars.get(spec)
        if grammar is not None and not (grammar.done() and grammar.exception() is not None):
            self._grammars.move_to_end(spec)
            return grammar
        if self._pool is None:
            # As vLLM: compiles are CPU work, half the cores at most (a compile also uses
            # xgrammar's own threads).
            self._pool = ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2) // 2)),
                                            thread_name_prefix="minivllm-grammar")
            self._compiler = self._pool.submit(self._make_compiler)
        grammar = self._pool.submit(self._compile_now, spec)
        self._grammars[spec] = grammar
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def _make_compiler(self) -> xgr.GrammarCompiler:
        """(On the pool: the vocabulary's token table takes a while for a large vocabulary.)"""
        import xgrammar as xgr

        assert self.tokenizer is not None, "InputProcessor refuses structured outputs without a tokenizer"
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, cache_limit_bytes=XGRAMMAR_CACHE_BYTES)

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        assert self._compiler is not None  # made with the pool
        return self._compiler.result().compile_grammar(spec.build())

    @property
    def has_compiling(self) -> bool:
        return bool(self._compiling)

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._compiling

    @property
    def num_compiling_seqs(self) -> int:
        """The sequences of the requests waiting for their grammar."""
        return sum(len(entry.seqs) for entry in self._compiling.values())

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until a waiting request's grammar is done, for at most timeout_s."""
        wait([entry.grammar for entry in self._compiling.values()], timeout_s, FIRST_COMPLETED)

    def take_compiled(self) -> list[tuple[str, BaseException | None]]:
        """The waiting requests whose grammar is done, each with the error that stopped its
        compile (None: compiled, and its sequences have their matchers: schedule them)."""
        done = [(request_id, entry) for request_id, entry in self._compiling.items() if entry.grammar.done()]
        taken = []
        for request_id, entry in done:
            del self._compiling[request_id]
            error = entry.grammar.exception()
            if error is None:
                self._start(entry.seqs, entry.grammar.result())
            else:
                logger.error("Request %s: its grammar did not compile: %s", request_id, error)
            taken.append((request_id, error))
        return taken

    def _start(self, seqs: list[Sequence], grammar: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        for seq in seqs:
            # The engine's stop tokens end the grammar (xgrammar's guess from the tokenizer when
            # there are none: ignore_eos without stop_token_ids).
            stop_token_ids = sorted(t for t in seq.params.all_stop_token_ids if t < self.vocab_size) or None
            ended = self.reasoner is None or self.reasoner.is_reasoning_end(seq.prompt_token_ids)
            matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stop_token_ids)
            self.guided[seq.seq_id] = _Guided(matcher, ended, frozenset(matcher.stop_token_ids))

    def remove(self, request_id: str, seqs: list[Sequence]) -> None:
        """Forget a request (finished or aborted), compiled or not."""
        self._compiling.pop(request_id, None)
        for seq in seqs:
            self.guided.pop(seq.seq_id, None)

    # --- steps ------------------------------------------------------------------------------

    def guided_rows(self, out: SchedulerOutput) -> GuidedRows | None:
        """The step's sampled rows of guided sequences; None where it has none."""
        guided, drafts = self.guided, out.draft_token_ids
        if drafts:
            seq_ids, positions, row_drafts = [], [], []
            position = 0
            for seq_id, samples in zip(out.seq_ids, out.samples):
                if samples:
                    these = drafts.get(seq_id, [])
                    if seq_id in guided:
                        seq_ids.append(seq_id)
                        positions.append(position)
                        row_drafts.append(these)
                    position += 1 + len(these)
            return GuidedRows(seq_ids, positions, row_drafts, position) if seq_ids else None
        # (The common step, without drafts: a position per sampled row; comprehensions, as the
        # rows of a whole batch pass here every step.)
        sampled = list(itertools.compress(out.seq_ids, out.samples))
        positions = [i for i, seq_id in enumerate(sampled) if seq_id in guided]
        if not positions:
            return None
        seq_ids = sampled if len(positions) == len(sampled) else [sampled[i] for i in positions]
        return GuidedRows(seq_ids, positions, [], len(sampled))

    def bitmask(self, rows: GuidedRows) -> GrammarBitmask | None:
        """The next-token masks of guided_rows' positions, from their matchers as they stand
        (after the tokens read back so far); None when none is masked (finished since, or still
        reasoning). A row's draft tokens are fed to its matcher one by one, each position's mask
        taken after the drafts before it, and taken back after: the mask where a draft breaks
        the grammar forbids that draft, so nothing past it is kept. The bitmask is one pinned
        buffer, rewritten each step: the engine reads a step back, which waits for its copy of
        the bitmask, before it asks for the next one.

        A sequence whose grammar has ended is forgotten (accept), so a row without a matcher is
        one whose sequence has finished since it was scheduled: its token is dropped. Where
        every position of the step is a guided row's, without drafts, and none reasons, the
        bitmask has a row per position (GrammarBitmask.rows None, the runner's cheaper case),
        and such a row allows every token."""
        if rows.drafts:
            return self._bitmask_along_drafts(rows)
        guided = self.guided
        matchers, filled, dropped = [], [], []
        every_position = rows.num_positions == len(rows.seq_ids)
        for position, seq_id in zip(rows.positions, rows.seq_ids):
            entry = guided.get(seq_id)
            if entry is None:
                dropped.append(position)
            elif entry.reasoning_ended:
                matchers.append(entry.matcher)
                filled.append(position)
            else:  # free text until its reasoning ends: never masked
                every_position = False
        if not matchers:
            return None
        if every_position:  # bitmask row = position
            bitmask = self._buffer(rows.num_positions)
            self._fill(matchers, bitmask, None if len(matchers) == rows.num_positions else filled)
            for position in dropped:
                bitmask[position] = -1
            return GrammarBitmask(None, bitmask[:rows.num_positions])
        bitmask = self._buffer(len(matchers))
        self._fill(matchers, bitmask, None)
        return GrammarBitmask(np.array(filled, dtype=np.int64), bitmask[:len(matchers)])

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The pinned bitmask buffer, at least num_rows rows."""
        import xgrammar as xgr

        if self._bitmask is None or len(self._bitmask) < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(self.max_num_seqs, num_rows), self.vocab_size)
            if self.pin_memory:
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask

    def _fill(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, rows: list[int] | None) -> None:
        """Fill bitmask row rows[i] (i where rows is None) with matchers[i]'s next-token mask."""
        import xgrammar as xgr

        threads = max(1, min(len(matchers) // ROWS_PER_FILL_THREAD, self._max_fill_threads))
        batch = self._batch_matchers.get(threads)
        if batch is None:
            batch = self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def _bitmask_along_drafts(self, rows: GuidedRows) -> GrammarBitmask | None:
        """bitmask for a step with draft tokens: the masked positions' rows, in order."""
        positions, matchers, drafted = [], [], []
        for position, seq_id, drafts in zip(rows.positions, rows.seq_ids, rows.drafts):
            guided = self.guided.get(seq_id)
            if guided is None:
                continue
            if drafts:
                drafted.append((position, drafts, guided))
            elif guided.reasoning_ended:
                positions.append(position)
                matchers.append(guided.matcher)
        num_masks = len(matchers) + sum(1 + len(drafts) for _, drafts, _ in drafted)
        if not num_masks:
            return None
        bitmask = self._buffer(num_masks)
        self._fill(matchers, bitmask, None)
        for position, drafts, guided in drafted:
            positions += self._fill_along_drafts(position, drafts, guided, bitmask, len(positions))
        if not positions:
            return None
        return GrammarBitmask(np.array(positions, dtype=np.int64), bitmask[:len(positions)])

    def _fill_along_drafts(self, position: int, drafts: list[int], guided: _Guided, bitmask: torch.Tensor,
                           first: int) -> list[int]:
        """Fill bitmask rows from `first` on with the masks of a row's positions (from
        `position` on; the state after the drafts before each), then take the drafts back out
        of its matcher; the positions filled. A position while reasoning, or past the grammar's
        end or a draft it refuses, gets no mask (its token is free, or not kept)."""
        matcher, reasoning_ended = guided.matcher, guided.reasoning_ended
        filled: list[int] = []
        accepted = 0
        for i in range(len(drafts) + 1):
            if reasoning_ended and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, first + len(filled))
                filled.append(position + i)
            if i == len(drafts):
                break
            draft = drafts[i]
            if not reasoning_ended:
                reasoning_ended = self.reasoner is None or self.reasoner.is_reasoning_end([draft])
            elif matcher.is_terminated() or not matcher.accept_token(draft):
                break
            else:
                accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return filled

    def accept(self, seq: Sequence, token: int) -> str | None:
        """Advance seq's matcher (if it has one) with its newly read-back token: "stop" once
        the grammar is complete (the token was a stop token), "error" if the grammar does not
        allow the token (the mask forbade it: a bug, which fails this sequence alone), else
        None. While the sequence reasons, the token only tells whether the reasoning ended."""
        guided = self.guided.get(seq.seq_id)
        if guided is None:
            return None
        if not guided.reasoning_ended:
            # The new token alone says whether it ends the reasoning (a scan of the whole output
            # at every step would grow with it).
            guided.reasoning_ended = self.reasoner is None or self.reasoner.is_reasoning_end([token])
            return None
        matcher = guided.matcher
        if not matcher.accept_token(token):
            logger.error("Sequence %d of request %s: its grammar does not allow token %d", seq.seq_id,
                         seq.request_id, token)
            return "error"
        if token in guided.stop_token_ids and matcher.is_terminated():
            # Its sequence ends here: forgotten now, so that a step's rows need not ask each
            # matcher whether it has ended.
            del self.guided[seq.seq_id]
            return "stop"
        return None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
