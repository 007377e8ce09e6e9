"""Sampler: pick each sequence's next token from the logits, batched on device (vLLM v1 semantics).

One step, for a batch of B rows of logits [B, V] (where structured outputs guide a row, the
runner has already set the tokens its grammar forbids to -inf, `apply_token_bitmask`, so
logprobs see the grammar, as in vLLM):

1. logprobs, when any row asks, come from the RAW logits (log_softmax before anything below).
2. allowed_token_ids: every other token of the row is set to -inf.
3. bad_words: a token that would complete one of the row's bad words (its other tokens being
   the row's latest outputs) is set to -inf.
4. min_tokens: until a row has min_tokens outputs, its stop tokens (and EOS) are set to -inf
   (unless nothing else is left: `block_stop_tokens`).
5. logit_bias: each biased token's value is added to its logit.
6. penalties: repetition (prompt or output tokens), frequency and presence (output tokens).
7. greedy rows (temperature ~ 0) take the argmax of the penalised logits.
8. random rows: with min_p, top_k or top_p, divide by temperature and set the filtered-out
   tokens to -inf; then sample with the Gumbel-max trick: argmax(logits + T * Gumbel noise)
   (T = 1 once divided), the same as argmax(logits / T + noise), is a sample from
   softmax(logits / T), with no softmax computed (`GumbelMaxSample`). With the Triton kernels
   (a Sampler built under use_triton_kernels, as for kernels="triton") two kernels
   (minivllm/kernels/sampling.py) draw the same distribution in two levels, chunks of the
   vocabulary then tokens of one chunk, the noise in registers; otherwise the formula in
   torch (`gumbel_noise`). A seeded row draws its randomness from its seed and the output
   position it samples alone (`SeededRows`), so its tokens do not depend on what else is in the
   batch, where its row is, or how many tokens a step samples for its sequence.

Steps 2 to 6 and the filters work on a float32 copy of the logits; a step that needs none of
them reads the model's logits as they are (the caller's tensor is never modified).
Nothing loops over the vocabulary in Python; the only Python loops are over rows when
building the metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from minivllm.layers.custom_op import CustomOp
from minivllm.sampling_params import GREEDY_EPSILON, SamplingParams

# top-p normally needs a sort of the whole vocabulary. When every top-p row also has a
# top_k no larger than this, torch.topk of that size already holds every candidate.
_MAX_TOP_K_WITHOUT_FULL_SORT = 1024

_NEG_INF = float("-inf")

# Per-step random draws: a 63-bit Philox key per row for the Triton kernels, 32-bit words per
# token for the torch formula.
_KEY_BITS = 63
_WORD_BITS = 32
# splitmix64's increment and multipliers, as int64 (two's complement: products wrap).
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


@dataclass
class SamplingRow:
    """One sequence's inputs for this step (host side)."""

    params: SamplingParams
    # The token history: outputs read by penalties, min_tokens and bad words, the prompt by
    # repetition_penalty (empty where nothing reads it: SequenceState.sampling_row).
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seed: int | None = None  # seeded requests: their sequence's seed


@dataclass
class SamplingMetadata:
    """Device tensors for one step. Optional tensors are None when no row needs them,
    so the sampler skips that work entirely."""

    vocab_size: int
    # [B] float32. Greedy rows hold 1.0 (their value is never used; dividing stays harmless).
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; None when all_greedy or all_random

    # Filters, for random rows only (greedy rows are set to "off" in every one of them).
    top_k: torch.Tensor | None  # [B] int64 in [0, V]; 0 = off
    max_top_k: int  # max over rows of top_k (host side: sizes torch.topk without a sync)
    top_p: torch.Tensor | None  # [B] float32; 1.0 = off
    sort_full_vocab: bool  # top-p needs a full sort (some top-p row has no small top_k)
    min_p: torch.Tensor | None  # [B] float32; 0.0 = off

    # Penalties. output_token_ids / frequency / presence are set together when any row has
    # a penalty; prompt_token_ids / repetition only when some row has repetition_penalty != 1.
    output_token_ids: torch.Tensor | None  # [B, Lo] int64, padded with vocab_size
    frequency_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64, padded with vocab_size
    repetition_penalty: torch.Tensor | None  # [B] float32

    # bad_words: the (row, token) pairs to block this step.
    bad_words_rows: torch.Tensor | None  # [W] int64
    bad_words_token_ids: torch.Tensor | None  # [W] int64

    # min_tokens: the (row, token) pairs to block this step.
    min_tokens_rows: torch.Tensor | None  # [M] int64
    min_tokens_token_ids: torch.Tensor | None  # [M] int64

    # logit_bias: one (row, token, value) triple per biased token of every row.
    logit_bias_rows: torch.Tensor | None  # [K] int64
    logit_bias_token_ids: torch.Tensor | None  # [K] int64
    logit_bias_values: torch.Tensor | None  # [K] float32
    # allowed_token_ids: the rows that have it, and per such row the tokens to block.
    allowed_rows: torch.Tensor | None  # [A] int64
    disallowed_mask: torch.Tensor | None  # [A, V] bool, True = set to -inf

    seeded: SeededRows | None  # the random rows with a seed; None: none
    max_num_logprobs: int | None  # max over rows of params.logprobs; None: nobody asks
    # Whether anything above depends on the rows' outputs so far (penalties, min_tokens still
    # blocking, bad words of several tokens): then this metadata is good for one step only.
    reads_outputs: bool

    def at_output_positions(self, positions: np.ndarray) -> SamplingMetadata:
        """This metadata for a step whose rows sample these output positions (int64 [B]: per
        row, the index among its sequence's outputs of the token it samples): with the seeded
        rows' keys for them. Itself where no row is seeded."""
        if self.seeded is None:
            return self
        return replace(self, seeded=self.seeded.at_output_positions(positions))

    @property
    def has_filters(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def edits_logits(self) -> bool:
        """Whether any step writes into the logits (then on a float32 copy)."""
        return (self.min_tokens_rows is not None or self.output_token_ids is not None
                or self.bad_words_rows is not None or self.logit_bias_rows is not None or self.allowed_rows is not None
                or self.has_filters)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int,
              device: torch.device | str) -> SamplingMetadata:
        device = torch.device(device)
        params = [row.params for row in rows]
        num_rows = len(rows)

        # One pass over the rows, one array for every float parameter (it travels to the
        # device in one copy; the rows below are views). float64 first, so that "greedy"
        # is decided exactly on the user's temperature.
        float_params = np.array([(p.temperature, p.top_p, p.min_p, p.presence_penalty,
                                  p.frequency_penalty, p.repetition_penalty) for p in params],
                                dtype=np.float64).reshape(num_rows, 6)
        greedy = float_params[:, 0] < GREEDY_EPSILON
        floats = np.ascontiguousarray(float_params.T, dtype=np.float32)
        temperature, top_p, min_p, presence, frequency, repetition = floats
        top_k = np.minimum(np.fromiter((p.top_k for p in params), dtype=np.int64, count=num_rows),
                           vocab_size)
        # Greedy rows ignore temperature and filters; turning them off here also means a
        # batch whose only top-k rows are greedy does no top-k work at all.
        temperature[greedy] = 1.0
        top_k[greedy] = 0
        top_p[greedy] = 1.0
        min_p[greedy] = 0.0

        use_top_k = bool(top_k.any())
        use_top_p = bool((top_p < 1.0).any())
        use_min_p = bool((min_p > 0.0).any())
        has_penalties = (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0)
        use_penalties = bool(has_penalties.any())
        use_repetition = bool((repetition != 1.0).any())
        max_top_k = int(top_k.max()) if use_top_k else 0
        top_p_rows = top_p < 1.0
        sort_full_vocab = use_top_p and bool(
            (top_k[top_p_rows] == 0).any() or max_top_k > _MAX_TOP_K_WITHOUT_FULL_SORT)

        # temperature, top_p, ... are views of floats: the greedy edits above are in it.
        device_floats = to_device(floats, device)
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())

        output_ids = prompt_ids = None
        if use_penalties:
            output_ids = to_device(_pad_token_ids(
                [row.output_token_ids if has_penalties[i] else () for i, row in enumerate(rows)],
                vocab_size), device)
        if use_repetition:
            # Only rows with a repetition penalty need their (possibly long) prompt.
            prompt_ids = to_device(_pad_token_ids(
                [row.prompt_token_ids if repetition[i] != 1.0 else () for i, row in enumerate(rows)],
                vocab_size), device)

        min_rows, min_tokens = _min_tokens_pairs(rows, vocab_size)
        bad_rows = bad_ids = None
        has_bad_words = any(p.bad_words_token_ids for p in params)
        if has_bad_words:
            bad_rows, bad_ids = _bad_words_pairs(rows)
        bias_rows = bias_ids = bias_values = allowed_rows = disallowed = None
        # Both are static per sequence, so they survive the reuse of a steady batch's metadata.
        if any(p.logit_bias for p in params):
            bias_rows, bias_ids, bias_values = _logit_bias_triples(params)
        if any(p.allowed_token_ids is not None for p in params):
            allowed_rows, disallowed = _disallowed_mask(params, vocab_size)

        return cls(
            vocab_size=vocab_size,
            temperature=device_floats[0],
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else to_device(greedy, device),
            top_k=to_device(top_k, device) if use_top_k else None,
            max_top_k=max_top_k,
            top_p=device_floats[1] if use_top_p else None,
            sort_full_vocab=sort_full_vocab,
            min_p=device_floats[2] if use_min_p else None,
            output_token_ids=output_ids,
            frequency_penalty=device_floats[4] if use_penalties else None,
            presence_penalty=device_floats[3] if use_penalties else None,
            prompt_token_ids=prompt_ids,
            repetition_penalty=device_floats[5] if use_repetition else None,
            bad_words_rows=None if bad_rows is None else to_device(bad_rows, device),
            bad_words_token_ids=None if bad_ids is None else to_device(bad_ids, device),
            min_tokens_rows=None if min_rows is None else to_device(min_rows, device),
            min_tokens_token_ids=None if min_tokens is None else to_device(min_tokens, device),
            logit_bias_rows=None if bias_rows is None else to_device(bias_rows, device),
            logit_bias_token_ids=None if bias_ids is None else to_device(bias_ids, device),
            logit_bias_values=None if bias_values is None else to_device(bias_values, device),
            allowed_rows=None if allowed_rows is None else to_device(allowed_rows, device),
            disallowed_mask=None if disallowed is None else to_device(disallowed, device),
            seeded=SeededRows.of([(i, row.seed) for i, row in enumerate(rows)
                                  if row.seed is not None and not greedy[i]], device),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None),
                                 default=None),
            reads_outputs=use_penalties or min_rows is not None or (
                has_bad_words and any(p.has_bad_word_prefixes for p in params)),
        )


@dataclass(frozen=True, slots=True)
class SeededRows:
    """A step's random rows that have a seed. Each draws its noise from one key, a hash of its
    seed and the output position it samples: what a sequence draws for its p-th output token
    depends on (seed, p) alone, not on the batch, where its row sits, or how many tokens the
    step samples for it (a verify step of speculative decoding draws at each position what a
    decode step would have there, so a seeded request's output is the one without speculation)."""

    host_rows: np.ndarray  # [S] int64
    rows: torch.Tensor  # [S] int64, on the sampler's device
    hashed_seeds: torch.Tensor  # [S] int64 on the host: _mix64 of each row's seed
    keys: torch.Tensor | None = None  # [S] int64 on the device, for one step (at_output_positions)

    @classmethod
    def of(cls, seeds: list[tuple[int, int]], device: torch.device) -> SeededRows | None:
        """From (row, seed) pairs (seeds in [-2**63, 2**64)); None for none."""
        if not seeds:
            return None
        rows = np.array([row for row, _ in seeds], dtype=np.int64)
        # As 64-bit words (n samples of a request seeded s use s, s + 1, ..., past 2**63 - 1 too).
        words = np.array([seed & (2**64 - 1) for _, seed in seeds], dtype=np.uint64).view(np.int64)
        return cls(rows, to_device(rows, device), _mix64(torch.from_numpy(words)))

    def at_output_positions(self, positions: np.ndarray) -> SeededRows:
        """These rows with their keys for a step whose rows sample `positions` (SamplingMetadata's)."""
        keys = _mix64(self.hashed_seeds + torch.from_numpy(positions[self.host_rows]))
        return replace(self, keys=to_device(keys.numpy(), self.rows.device))


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words (wrapping, as unsigned): a bijection that scatters
    nearby inputs over all 64 bits."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits of int64 words taken as unsigned (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, copied without waiting for the device."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        # Pinned memory makes the copy truly asynchronous; the caching host allocator keeps
        # the buffer alive until the copy has finished.
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _pad_token_ids(lists: Sequence[Sequence[int]], pad: int) -> np.ndarray:
    """Ragged token-id lists -> [len(lists), max_len] int64, padded with pad (= vocab_size,
    which lands in a spare column that the sampler drops)."""
    lengths = [len(ids) for ids in lists]
    out = np.full((len(lists), max(lengths, default=0) or 1), pad, dtype=np.int64)
    for i, ids in enumerate(lists):  # over rows, not tokens: numpy converts each row in C
        out[i, :lengths[i]] = ids
    return out


def _min_tokens_pairs(rows: list[SamplingRow],
                      vocab_size: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(row, token) pairs to block: rows still short of min_tokens, their stop token ids plus
    all_stop_token_ids (EOS unless ignore_eos, as the engine fills it)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        blocked = [t for t in set(p.stop_token_ids or ()) | p.all_stop_token_ids if 0 <= t < vocab_size]
        row_ids += [i] * len(blocked)
        token_ids += blocked
    if not row_ids:
        return None, None
    return np.array(row_ids, dtype=np.int64), np.array(token_ids, dtype=np.int64)


def _bad_words_pairs(rows: list[SamplingRow]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(row, token) pairs to block: each bad word's last token, where the row's latest output
    tokens are the word's others (a word of one token: always). As vLLM, only outputs count:
    a word is not completed across the end of the prompt."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        outputs = row.output_token_ids
        for word in row.params.bad_words_token_ids:
            start = len(outputs) - (len(word) - 1)  # where the word's other tokens would start
            if start >= 0 and list(outputs[start:]) == word[:-1]:
                row_ids.append(i)
                token_ids.append(word[-1])
    if not row_ids:
        return None, None
    return np.array(row_ids, dtype=np.int64), np.array(token_ids, dtype=np.int64)


def _logit_bias_triples(params: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token id, bias) for every biased token of every row (ids checked against the
    vocabulary when the request was added)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            row_ids += [i] * len(p.logit_bias)
            token_ids += p.logit_bias.keys()
            values += p.logit_bias.values()
    return (np.array(row_ids, dtype=np.int64), np.array(token_ids, dtype=np.int64),
            np.array(values, dtype=np.float32))


def _disallowed_mask(params: list[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows with allowed_token_ids, and for each a [V] mask of the tokens it blocks; rows
    without the parameter get no mask row at all."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    mask = np.ones((len(rows), vocab_size), dtype=np.bool_)
    for j, i in enumerate(rows):
        mask[j, params[i].allowed_token_ids] = False
    return np.array(rows, dtype=np.int64), mask


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # [B, 1 + max_num_logprobs]: column 0 the sampled token, then the top-k by logprob.
    logprob_token_ids: torch.Tensor | None  # int64
    logprobs: torch.Tensor | None  # float32, matching logprob_token_ids
    sampled_token_ranks: torch.Tensor | None  # [B] int64, rank of the sampled token (1 = best)


class Sampler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gumbel_max_sample = GumbelMaxSample()

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Raw logprobs first, before anything changes the logits (vLLM's default).
        raw_logprobs = (torch.log_softmax(logits.float(), dim=-1)
                        if meta.max_num_logprobs is not None else None)
        if meta.edits_logits:
            logits = self.penalised_logits(logits, meta)
        sampled = self.sample(logits, meta)
        if raw_logprobs is None or meta.max_num_logprobs is None:  # both None, or neither
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    # The steps, public so tests (and debugging) can look at each stage.

    def penalised_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """A float32 copy of logits with allowed_token_ids, bad_words, min_tokens blocking,
        logit_bias and penalties applied (vLLM's order). Every later step works in place on this copy; the
        caller's logits are never modified."""
        # Padding ids equal vocab_size must land outside the real vocabulary.
        assert logits.shape[-1] == meta.vocab_size, (logits.shape, meta.vocab_size)
        logits = logits.to(torch.float32, copy=True)
        if meta.allowed_rows is not None:
            assert meta.disallowed_mask is not None  # set with allowed_rows
            logits[meta.allowed_rows] = logits[meta.allowed_rows].masked_fill_(meta.disallowed_mask, _NEG_INF)
        if meta.bad_words_rows is not None:
            logits[meta.bad_words_rows, meta.bad_words_token_ids] = _NEG_INF
        if meta.min_tokens_rows is not None:
            assert meta.min_tokens_token_ids is not None  # set with min_tokens_rows
            block_stop_tokens(logits, meta.min_tokens_rows, meta.min_tokens_token_ids)
        if meta.logit_bias_rows is not None:
            assert meta.logit_bias_token_ids is not None and meta.logit_bias_values is not None
            logits.index_put_((meta.logit_bias_rows, meta.logit_bias_token_ids), meta.logit_bias_values,
                              accumulate=True)
        if meta.output_token_ids is not None:
            logits = apply_penalties(logits, meta)
        return logits

    def processed_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The logits each row samples from: random rows sample softmax of their row, greedy
        rows (temperature 1, no filters) take its argmax. Filtered-out tokens are -inf."""
        return self.filter_logits(self.penalised_logits(logits, meta), meta)

    def filter_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, then min_p, top_k, top_p (in place on penalised logits)."""
        logits.div_(meta.temperature.unsqueeze(1))
        if meta.min_p is not None:
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf is off.
            threshold = logits.amax(dim=-1, keepdim=True) + meta.min_p.log().unsqueeze(1)
            logits.masked_fill_(logits < threshold, _NEG_INF)
        if meta.top_k is not None or meta.top_p is not None:
            cutoff = _top_k_top_p_cutoff(logits, meta)
            logits.masked_fill_(logits < cutoff.unsqueeze(1), _NEG_INF)
        return logits

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Next token per row from penalised logits: penalised_logits' copy when
        meta.edits_logits (the filters then work in place on it), else the model's logits,
        any float dtype, only read."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        # Before the filters below, which work in place on these logits.
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.has_filters:  # the filters need the scaled logits: scale them in place
            sampled = self.gumbel_max_sample(self.filter_logits(logits, meta), None, meta.seeded)
        else:  # the noise is scaled instead, in the same pass
            sampled = self.gumbel_max_sample(logits, meta.temperature, meta.seeded)
        if greedy is None or meta.greedy_mask is None:  # all_random: both None
            return sampled
        return torch.where(meta.greedy_mask, greedy, sampled)


def block_stop_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """min_tokens: logits[rows[i], token_ids[i]] = -inf, except in a row where nothing else is
    left (a grammar or allowed_token_ids that allows only stopping): that row may still stop,
    rather than sample a token nothing allows. No host synchronisation."""
    kept = logits[rows, token_ids]
    logits[rows, token_ids] = _NEG_INF
    nothing_left = logits.amax(dim=-1) == _NEG_INF
    logits[rows, token_ids] = torch.where(nothing_left[rows], kept, _NEG_INF)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: np.ndarray | None) -> None:
    """Set to -inf, in place, every token of logits[rows[i]] that bitmask[i] does not allow, and
    every token past the bitmask's width (rows None: row i is logits' row i). Both on the host,
    copied to logits' device without waiting where the bitmask is pinned. xgrammar's layout:
    bit t % 32 of int32 word t // 32 is token t, 1 = allowed; unpacked a byte at a time
    (little-endian words: byte k holds tokens 8k .. 8k + 7) into one bool per token. (Few
    kernels: each launch is host time in the step that waits for the grammar.)"""
    device = logits.device
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    words = bitmask.to(device, non_blocking=True)
    width = min(vocab_size, bitmask.shape[1] * 32)
    blocked = (words.view(torch.uint8).unsqueeze(-1) & _bit_values(device)).view(num_rows, -1)[:, :width] == 0
    index = None if rows is None else to_device(rows, device)
    masked = logits if index is None else logits[index]
    if width < vocab_size:  # tokens past the bitmask (past the tokenizer's ids): never allowed
        masked[:, width:].fill_(_NEG_INF)
    masked[:, :width].masked_fill_(blocked, _NEG_INF)
    if index is not None:
        logits[index] = masked


@functools.cache
def _bit_values(device: torch.device) -> torch.Tensor:
    """uint8 [8] on device: the value of each bit of a byte (made there, once: a copy from the
    host would wait for the device)."""
    return torch.ones(8, dtype=torch.uint8, device=device).bitwise_left_shift_(
        torch.arange(8, dtype=torch.uint8, device=device))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (tokens in prompt or output: positive logits divided, others multiplied),
    then frequency * count and presence * (count > 0) over output tokens, both subtracted."""
    num_rows, vocab = logits.shape
    output_ids = meta.output_token_ids
    # SamplingMetadata.build sets these together, for a batch with penalties.
    assert output_ids is not None and meta.frequency_penalty is not None and meta.presence_penalty is not None
    # Padding ids equal vocab: they count into a spare last column, dropped afterwards.
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones(output_ids.shape, dtype=torch.float32,
                                                  device=logits.device))
    counts = counts[:, :vocab]
    in_output = counts > 0
    if meta.repetition_penalty is not None:
        assert meta.prompt_token_ids is not None  # set with repetition_penalty
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, meta.prompt_token_ids, True)
        seen = seen[:, :vocab] | in_output
        penalty = torch.where(seen, meta.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= meta.frequency_penalty.unsqueeze(1) * counts
    logits -= meta.presence_penalty.unsqueeze(1) * in_output
    return logits


def _top_k_top_p_cutoff(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Per-row logit cutoff [B]: keep tokens with logit >= cutoff (ties with the cutoff stay).

    The candidates are the row's logits in descending order: torch.topk of max_top_k when
    that holds every candidate (top-k alone, or every top-p row also has a small top_k),
    else a full sort. The kept set is always a prefix of that order, so one cutoff value
    per row describes it and we never scatter a sorted tensor back."""
    if meta.sort_full_vocab:
        candidates = logits.sort(dim=-1, descending=True).values
    else:
        candidates = logits.topk(meta.max_top_k, dim=-1).values
    num_candidates = candidates.shape[1]
    cutoff = torch.full((logits.shape[0],), _NEG_INF, device=logits.device)

    if meta.top_k is not None:
        k = meta.top_k.clamp(1, num_candidates)
        kth_largest = candidates.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(meta.top_k > 0, kth_largest, cutoff)
        candidates = candidates.masked_fill(candidates < cutoff.unsqueeze(1), _NEG_INF)

    if meta.top_p is not None:
        # Keep the smallest prefix whose probability reaches top_p: token j stays iff the
        # mass strictly before it is < top_p (so the top token always stays). top_p is
        # renormalised over what min_p and top_k left, as in vLLM.
        probs = candidates.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1)[:, :-1]
        num_kept = 1 + (mass_before < meta.top_p.unsqueeze(1)).sum(dim=-1)
        top_p_cutoff = candidates.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
        # top_p = 1 is off; rounding in the cumsum must not drop the tail.
        top_p_cutoff = torch.where(meta.top_p < 1.0, top_p_cutoff, _NEG_INF)
        cutoff = torch.maximum(cutoff, top_p_cutoff)
    return cutoff


class GumbelMaxSample(CustomOp):
    """forward(logits [B, V], temperature [B] or None, seeded) -> [B] int64: per row, a
    sample from softmax(logits / T) (temperature None: T = 1, the logits are scaled already):
    argmax_j(logits_j + T * G_j) with G_j ~ Gumbel(0, 1) i.i.d.

    Seeded rows (seeded: SeededRows, with this step's keys) take their randomness from their
    key only; the other rows from the device's default generator. With Triton: one Philox key
    per row and step (kernels/sampling.py's two kernels derive all of the row's noise from it,
    in two levels; tests run them on CPU under Triton's interpreter). In torch: 32-bit words
    per token, turned into noise by gumbel_noise. Either way a row's noise does not depend on
    the batch. No host synchronisation."""

    def forward_triton(self, logits: torch.Tensor, temperature: torch.Tensor | None,
                       seeded: SeededRows | None) -> torch.Tensor:
        from minivllm.kernels import sampling  # imported only where Triton is used
        num_rows = logits.shape[0]
        keys = _draw_per_row(num_rows, 1, _KEY_BITS, seeded, logits.device)
        return sampling.gumbel_max_sample(logits, keys.view(num_rows), temperature)

    def forward_native(self, logits: torch.Tensor, temperature: torch.Tensor | None,
                       seeded: SeededRows | None) -> torch.Tensor:
        num_rows, vocab_size = logits.shape
        noise = gumbel_noise(_draw_per_row(num_rows, vocab_size, _WORD_BITS, seeded, logits.device))
        if temperature is not None:
            noise.mul_(temperature.unsqueeze(1))
        return noise.add_(logits).argmax(dim=-1)


def _draw_per_row(num_rows: int, width: int, bits: int, seeded: SeededRows | None,
                  device: torch.device) -> torch.Tensor:
    """[num_rows, width] int64, uniform in [0, 2**bits): a seeded row's from its key (word j
    the top bits of splitmix64's j-th output after it: a counter, so that the row's draws are
    its key's whatever else the step draws), the others' from the device's default generator
    (not touched when every row is seeded)."""
    draws = torch.empty(num_rows, width, dtype=torch.int64, device=device)
    if seeded is None or len(seeded.host_rows) < num_rows:
        if bits < 63:
            draws.random_(0, 2**bits)
        else:
            draws.random_()  # [0, 2**63): its bound, 2**63, is past int64
    if seeded is not None:
        assert seeded.keys is not None, "seeded rows draw at output positions: SamplingMetadata.at_output_positions"
        counters = torch.arange(1, width + 1, dtype=torch.int64, device=device) * _GOLDEN_GAMMA
        draws[seeded.rows] = _shift_right(_mix64(seeded.keys.unsqueeze(1) + counters), 64 - bits)
    return draws


def gumbel_noise(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise (float32) from uniform 32-bit words (an int64 tensor in [0, 2**32)):
    w = (r + 1/2) / 2**32, E = -log(1 - w) ~ Exp(1), G = -log(E). The same float32 steps as
    the Triton kernel's `_gumbel_noise` (minivllm/kernels/sampling.py, whose docstring says
    why E comes from a series for small w, why w is clamped below 1, and how closely its
    compiled logs agree with these)."""
    w = (bits.float() + 0.5).mul_(2.0**-32).clamp_(max=1.0 - 2.0**-24)
    series = w + w * w * (0.5 + w * (1 / 3 + w * 0.25))
    e = torch.where(w < 2.0**-6, series, (1.0 - w).log_().neg_())
    return e.log_().neg_()


def gather_logprobs(raw_logprobs: torch.Tensor, chosen: torch.Tensor,
                    num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Column 0 the chosen token of each row (the sampled one, or a prompt token), then the
    top num_logprobs; and the chosen token's rank, counted as vLLM does: how many tokens have
    a logprob >= its own (1 = most likely)."""
    token_logprob = raw_logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (raw_logprobs >= token_logprob).sum(dim=-1)
    token_ids = chosen.unsqueeze(1)
    logprobs = token_logprob
    if num_logprobs > 0:
        top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        logprobs = torch.cat([logprobs, top_logprobs], dim=1)
    return token_ids, logprobs, ranks
