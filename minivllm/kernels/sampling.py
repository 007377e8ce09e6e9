"""Gumbel-max sampling in two passes over the logits: the random rows of the sampler's step.

argmax_j(logits_j + T * G_j), with G_j ~ Gumbel(0, 1) i.i.d., is a sample from
softmax(logits / T): dividing by T > 0 does not move an argmax, and the softmax's
normaliser never does. Drawn in one pass, that is a 32-bit random word and two logs for
every token of the vocabulary, which makes the pass compute-bound (~4x the time of reading
the logits at B = 256, V = 151,936 on an H200). It is drawn in two levels instead, with
the same distribution:

1. The vocabulary is cut into chunks of _CHUNK tokens. The maximum of
   logits_j / T + G_j over a chunk is itself Gumbel-distributed, around the chunk's
   logsumexp(logits / T); so the chunk that holds the winning token is the argmax over
   chunks of logsumexp_c + G_c, with one Gumbel G_c per chunk. The first pass reads every
   logit once and computes these chunk scores (one exp per token).
2. Given that chunk, the winning token is distributed as the softmax over the chunk's
   tokens alone, which a Gumbel-max over them draws (with noise independent of the G_c).
   The second pass draws per-token noise for that one chunk: _CHUNK tokens a row, not V.

Tokens filtered to -inf stay -inf and a chunk of them scores -inf (all noise is finite), so
one is picked only from a row with no finite logit at all (its first token).

Why kernels: the torch way (a float32 copy, the division by T, a softmax, a [B, V] tensor
of exponential noise, a division and an argmax) moves ~50 bytes per logit; these read each
logit once (and one chunk a row again), in its own dtype, and draw the noise in registers:
at B = 256, V = 151,936 in bf16, 78 MB. benchmarks/kernels/sampler.py times both.

The noise. Token j of a row with seed s gets the 32-bit word j % 4 of Philox4x32-10 with
key s and counter (j // 4, 0) (tl.randint4x: one Philox evaluation feeds four tokens);
chunk c gets word 0 of counter (c, 1). The sample thus depends on the row's seed and
logits only, never on the batch or where the row sits.
From a word r: w = (r + 1/2) / 2**32 in (0, 1), E = -log(1 - w) ~ Exp(1) and G = -log(E).
The samples that win are those with a small E (w near 0), so E is computed from w,
which float32 resolves finely near 0 (steps of 2**-32), and not from 1 - w (steps of
2**-24 near 1, i.e. a coarse E exactly where the winners are): for w < 2**-6 by its
series w + w^2/2 + w^3/3 + w^4/4 (the rest is below 2**-26 relatively), above by the log.
w is clamped below 1, so E is at most -log(2**-24) = 16.6 and G lies in [-2.82, 22.9].
The torch twin of this formula, for CPU tensors, is `gumbel_noise` in
minivllm/layers/sampler.py; tests check one against the other. Compiled, the kernels take
the noise's logs from the GPU's approximate log2 (`_log`), and the chunks' exps and logs
from the approximate exp2 and log2, so they agree with the twin to ~2**-22 relatively
rather than to the last bit.

Ties (equal scores) go to the smallest chunk, and within it to the smallest token index.
Nothing synchronises with the host.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minivllm.kernels.common import INTERPRETED, cdiv, next_power_of_2

# Tokens per chunk (a power of two, a multiple of 4): the second pass's work per row. Fixed,
# whatever the batch, so that a row's sample never depends on what else is in it.
_CHUNK = 2048
_NUM_WARPS = 4  # 16 tokens per thread in either pass
# Chunks a first-pass program scores in turn: a third of the programs, each loading its row's
# seed and temperature once. Faster than a program a chunk at 64-256 rows on an H200, a little
# slower at 16; 5 or 8 a program were no faster (docs/perf-log.md).
_CHUNKS_PER_PROGRAM = 3


@triton.jit
def _log(x):
    """Natural log. Compiled: through the GPU's approximate log2 instruction (lg2.approx,
    relative error ~2**-22), one instruction where tl.log is a ~30-instruction libdevice
    routine; two logs per token made those routines most of the kernel's work. The
    interpreter has no such instruction (and needs none): tl.log."""
    if INTERPRETED:
        return tl.log(x)
    return 0.6931471805599453 * libdevice.fast_log2f(x)


@triton.jit
def _gumbel_noise(bits):
    """Gumbel(0, 1) noise from uniform uint32 words, as the module docstring derives it."""
    tl.static_assert(bits.dtype == tl.uint32)  # a signed word would make w negative
    w = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32; never 0
    w = tl.minimum(w, 0.99999994)  # 1 - 2**-24: r near 2**32 rounds w to 1.0
    series = w + w * w * (0.5 + w * (0.3333333333333333 + w * 0.25))
    e = tl.where(w < 0.015625, series, -_log(1.0 - w))  # -log(1 - w), accurate near w = 0
    return -_log(e)


@triton.jit
def _chunk_scores_kernel(
    logits_ptr, stride_row,
    temperature_ptr,  # [B] float32; read only when HAS_TEMPERATURE
    seeds_ptr,  # [B] int64: the Philox key of each row
    scores_ptr,  # [B, num_chunks] float32: each chunk's log-sum-exp plus its Gumbel noise
    vocab_size, num_chunks,
    HAS_TEMPERATURE: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS_PER_PROGRAM: tl.constexpr,
):
    """First pass, one program per row and CHUNKS_PER_PROGRAM chunks: each chunk's score
    logsumexp(logits / T) + G, with G the chunk's own Gumbel noise (word 0 of counter (chunk, 1))."""
    row = tl.program_id(0)
    if HAS_TEMPERATURE:
        scale = 1.4426950408889634 / tl.load(temperature_ptr + row)  # log2(e) / T: base 2
    else:
        scale = 1.4426950408889634
    seed = tl.load(seeds_ptr + row)
    for i in tl.range(0, CHUNKS_PER_PROGRAM, num_stages=2):
        chunk = tl.program_id(1) * CHUNKS_PER_PROGRAM + i
        if chunk < num_chunks:
            cols = chunk * CHUNK + tl.arange(0, CHUNK)
            x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab_size,
                        other=float("-inf")).to(tl.float32) * scale
            top = tl.max(x, axis=0)
            # An all -inf chunk sums to 0 (its log is -inf), a +inf logit to +inf: either way the
            # reference point must be finite, or x - top would be NaN.
            ref = tl.where(tl.abs(top) == float("inf"), 0.0, top)
            lse = 0.6931471805599453 * (ref + tl.log2(tl.sum(tl.exp2(x - ref), axis=0)))
            r0, _, _, _ = tl.randint4x(seed, chunk.to(tl.int64) + (1 << 32))
            tl.store(scores_ptr + row * num_chunks + chunk, lse + _gumbel_noise(r0))


@triton.jit
def _sample_in_chunk_kernel(
    logits_ptr, stride_row,
    temperature_ptr,  # [B] float32; read only when HAS_TEMPERATURE
    seeds_ptr,  # [B] int64: the Philox key of each row
    scores_ptr,  # [B, num_chunks] float32, from _chunk_scores_kernel
    out_ptr,  # [B] int64: the sampled tokens
    vocab_size, num_chunks,
    HAS_TEMPERATURE: tl.constexpr,
    CHUNK: tl.constexpr,  # a multiple of 4
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
):
    """Second pass, one program per row: the best-scoring chunk (the first of equal scores;
    a NaN score counts as -inf), then the Gumbel-max over its tokens."""
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_POW2)
    scores = tl.load(scores_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    scores = tl.where(scores == scores, scores, float("-inf"))
    chunk = tl.min(tl.where(scores == tl.max(scores, axis=0), c, CHUNKS_POW2), axis=0)

    # The chunk as a [CHUNK // 4, 4] tile: token 4t + q of the vocabulary takes word q of
    # counter t, so the four words of one Philox evaluation are four neighbours.
    t = chunk * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
    q = tl.arange(0, 4)[None, :]
    cols = 4 * t[:, None] + q
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab_size,
                other=float("-inf")).to(tl.float32)
    r0, r1, r2, r3 = tl.randint4x(tl.load(seeds_ptr + row), t)
    bits = tl.where(q == 0, r0[:, None], tl.where(q == 1, r1[:, None],
                                                  tl.where(q == 2, r2[:, None], r3[:, None])))
    if HAS_TEMPERATURE:
        score = x + tl.load(temperature_ptr + row) * _gumbel_noise(bits)
    else:
        score = x + _gumbel_noise(bits)
    score = tl.where(score == score, score, float("-inf"))  # NaN logits (a broken model) never win
    top = tl.max(tl.max(score, axis=1), axis=0)
    # The first of equal scores; a chunk with no finite logit (a row with none) answers its first token.
    first = tl.min(tl.min(tl.where(score == top, cols, vocab_size), axis=1), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def gumbel_max_sample(logits: torch.Tensor, seeds: torch.Tensor,
                      temperature: torch.Tensor | None = None) -> torch.Tensor:
    """[B] int64: per row, a sample from softmax(logits[b] / temperature[b]), drawn as the
    module docstring says from the row's Philox key seeds[b]; temperature None means 1
    (logits already scaled).

    logits: [B, V] float32, float16 or bfloat16, last dimension contiguous (read, never
    written); seeds: [B] int64 on the same device; temperature: [B] float32, > 0.
    """
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 or vocab_size == 1, "logits' last dimension must be contiguous"
    assert seeds.shape == (num_rows,) and seeds.dtype == torch.int64, (seeds.shape, seeds.dtype)
    if temperature is not None:
        assert temperature.shape == (num_rows,) and temperature.dtype == torch.float32, (
            temperature.shape, temperature.dtype)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks = cdiv(vocab_size, _CHUNK)
    scores = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    temperature_arg = temperature if temperature is not None else logits  # (unread placeholder)
    common = dict(HAS_TEMPERATURE=temperature is not None, CHUNK=_CHUNK, num_warps=_NUM_WARPS)
    _chunk_scores_kernel[(num_rows, cdiv(num_chunks, _CHUNKS_PER_PROGRAM))](
        logits, logits.stride(0), temperature_arg, seeds, scores, vocab_size, num_chunks,
        CHUNKS_PER_PROGRAM=_CHUNKS_PER_PROGRAM, **common)
    _sample_in_chunk_kernel[(num_rows,)](
        logits, logits.stride(0), temperature_arg, seeds, scores, out, vocab_size, num_chunks,
        CHUNKS_POW2=next_power_of_2(num_chunks), **common)
    return out


def warm_up(vocab_size: int, logits_dtype: torch.dtype, device: torch.device) -> None:
    """Compile every variant the sampler can launch before a request needs it (a compilation
    inside a step stalls it for about a second): the model's logits with the temperature
    applied in the kernel, and a float32 copy (after penalties or filters) with and without."""
    seeds = torch.zeros(1, dtype=torch.int64, device=device)
    temperature = torch.ones(1, dtype=torch.float32, device=device)
    for dtype, scale in ((logits_dtype, temperature), (torch.float32, temperature), (torch.float32, None)):
        gumbel_max_sample(torch.zeros(1, vocab_size, dtype=dtype, device=device), seeds, scale)
