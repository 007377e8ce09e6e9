"""Gumbel-max sampling in one pass over the logits: the random rows of the sampler's step.

argmax_j(logits_j + T * G_j), with G_j ~ Gumbel(0, 1) i.i.d., is a sample from
softmax(logits / T): dividing by T > 0 does not move an argmax, and the softmax's
normaliser never does. Tokens filtered to -inf stay -inf (the noise is always finite), so
one is picked only from a row with no finite logit at all.

Why a kernel: the torch way (a float32 copy, the division by T, a softmax, a [B, V] tensor
of exponential noise, a division and an argmax) moves ~50 bytes per logit; this reads each
logit once, in its own dtype, and draws the noise in registers: at B = 256, V = 151,936 in
bf16 it reads 78 MB. benchmarks/kernels/sampler.py times both (--sweep tries other launch
configs).

The noise. Token j of a row with seed s gets the 32-bit word j % 4 of Philox4x32-10 with
key s and counter j // 4 (tl.randint4x: one Philox evaluation feeds four tokens; one per
token, its ten rounds of 32-bit multiplies would take about as long as reading the logits,
by our estimate for an H200). The noise of a row thus depends on its seed and the token
index only, never on the batch, the launch configuration or where the row sits.
From the word r: w = (r + 1/2) / 2**32 in (0, 1), E = -log(1 - w) ~ Exp(1) and G = -log(E).
The samples that win are those with a small E (w near 0), so E is computed from w,
which float32 resolves finely near 0 (steps of 2**-32), and not from 1 - w (steps of
2**-24 near 1, i.e. a coarse E exactly where the winners are): for w < 2**-6 by its
series w + w^2/2 + w^3/3 + w^4/4 (the rest is below 2**-26 relatively), above by the log.
w is clamped below 1, so E is at most -log(2**-24) = 16.6 and G lies in [-2.82, 22.9].
The torch twin of this formula, for CPU tensors, is `gumbel_noise` in
minivllm/layers/sampler.py; tests check one against the other. Compiled, the kernel takes
both logs from the GPU's approximate log2 (`_log`), so it agrees with the twin to ~2**-22
relatively rather than to the last bit.

Ties (equal scores) go to the smallest token index, whatever the launch configuration.
Nothing synchronises with the host.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minivllm.kernels import INTERPRETED, cdiv, next_power_of_2, sm_count, split_count

_BLOCK = 2048  # tokens per loop iteration: 16 per thread with 4 warps, several loads in flight
_NUM_WARPS = 4
_PROGRAMS_PER_SM = 4  # enough resident programs to keep each SM's loads in flight
_MIN_TOKENS_PER_SPLIT = 2048  # below that, a program's fixed cost outweighs its share
_REDUCE_BLOCK = 128  # splits per iteration of the second pass


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


# num_splits follows the batch size: one compilation for all of them (split_len is a
# multiple of BLOCK, the stride and vocabulary size are the model's).
@triton.jit(do_not_specialize=["num_splits"])
def _gumbel_max_split_kernel(
    logits_ptr, stride_row,
    temperature_ptr,  # [B] float32; read only when HAS_TEMPERATURE
    seeds_ptr,  # [B] int64: the Philox key of each row
    max_ptr, argmax_ptr,  # [B, num_splits] float32 / int64: each split's best score and token
    vocab_size, split_len, num_splits,
    HAS_TEMPERATURE: tl.constexpr,
    BLOCK: tl.constexpr,  # a multiple of 4; split_len is a multiple of BLOCK
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_size)

    # A chunk as a [BLOCK // 4, 4] tile: token start + 4t + q takes word q of counter
    # start // 4 + t, so the four words of one Philox evaluation are four neighbours.
    t = tl.arange(0, BLOCK // 4)
    q = tl.arange(0, 4)[None, :]
    tile = 4 * t[:, None] + q
    best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    best_idx = lo + tile  # an all -inf split answers its first token
    for start in range(lo, hi, BLOCK):
        cols = start + tile
        x = tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + t)
        bits = tl.where(q == 0, r0[:, None], tl.where(q == 1, r1[:, None],
                                                      tl.where(q == 2, r2[:, None], r3[:, None])))
        if HAS_TEMPERATURE:
            score = x + temperature * _gumbel_noise(bits)
        else:
            score = x + _gumbel_noise(bits)
        # Strictly greater: each lane keeps the first of equal scores (its tokens ascend).
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)

    top = tl.max(tl.max(best, axis=1), axis=0)
    first = tl.min(tl.min(tl.where(best == top, best_idx, vocab_size), axis=1), axis=0)
    tl.store(max_ptr + row * num_splits + split, top)
    tl.store(argmax_ptr + row * num_splits + split, first.to(tl.int64))


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_of_splits_kernel(max_ptr, argmax_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    """One program per row: the best split's token; on equal scores the earliest split's
    (splits hold ascending tokens). A loop over BLOCK_S splits at a time rather than one
    block of next_power_of_2(num_splits): one compilation for every batch size."""
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    best = tl.full([BLOCK_S], float("-inf"), tl.float32)
    best_token = tl.full([BLOCK_S], 2**62, tl.int64)
    for start in range(0, num_splits, BLOCK_S):
        valid = start + s < num_splits
        scores = tl.load(max_ptr + row * num_splits + start + s, mask=valid, other=float("-inf"))
        tokens = tl.load(argmax_ptr + row * num_splits + start + s, mask=valid, other=2**62)
        # Lane-wise, later splits hold later tokens: only a strictly better score replaces;
        # the first iteration takes every valid lane (a row may be all -inf).
        better = valid & ((scores > best) | (best_token == 2**62))
        best = tl.where(better, scores, best)
        best_token = tl.where(better, tokens, best_token)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_token, 2**62), axis=0))


def _launch_config(num_rows: int, vocab_size: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK, num_splits, num_warps). One program per row leaves most SMs idle at small
    batches (B = 1 would read at one SM's bandwidth), so each row's vocabulary is split
    until the launch has _PROGRAMS_PER_SM programs per SM, but no split under
    _MIN_TOKENS_PER_SPLIT tokens. Depends on host integers only."""
    block = min(_BLOCK, max(16, next_power_of_2(vocab_size)))
    num_splits = split_count(_PROGRAMS_PER_SM * sm_count(device), num_rows, vocab_size,
                             max(block, _MIN_TOKENS_PER_SPLIT))
    return block, num_splits, _NUM_WARPS


def gumbel_max_sample(logits: torch.Tensor, seeds: torch.Tensor,
                      temperature: torch.Tensor | None = None) -> torch.Tensor:
    """[B] int64: per row, argmax_j(logits[b, j] + temperature[b] * G(seeds[b], j)), where
    G(s, j) is the Gumbel noise of the module docstring; temperature None means 1 (logits
    already scaled). That is a sample from softmax(logits[b] / temperature[b]).

    logits: [B, V] float32, float16 or bfloat16, last dimension contiguous (read, never
    written); seeds: [B] int64 on the same device; temperature: [B] float32, > 0.
    """
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 or vocab_size == 1, "logits' last dimension must be contiguous"
    assert seeds.shape == (num_rows,) and seeds.dtype == torch.int64, (seeds.shape, seeds.dtype)
    if temperature is not None:
        assert temperature.shape == (num_rows,) and temperature.dtype == torch.float32, (
            temperature.shape, temperature.dtype)
    device = logits.device
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    block, num_splits, num_warps = _launch_config(num_rows, vocab_size, device)
    split_len = cdiv(cdiv(vocab_size, num_splits), block) * block
    num_splits = cdiv(vocab_size, split_len)  # rounding split_len up may leave fewer
    maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=device)
    argmax = out.view(num_rows, 1) if num_splits == 1 else torch.empty(
        num_rows, num_splits, dtype=torch.int64, device=device)
    _gumbel_max_split_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), temperature if temperature is not None else logits, seeds,
        maxima, argmax, vocab_size, split_len, num_splits,
        HAS_TEMPERATURE=temperature is not None, BLOCK=block,
        num_warps=num_warps,
    )
    if num_splits > 1:
        _argmax_of_splits_kernel[(num_rows,)](
            maxima, argmax, out, num_splits, BLOCK_S=_REDUCE_BLOCK, num_warps=1)
    return out


def warm_up(vocab_size: int, logits_dtype: torch.dtype, device: torch.device) -> None:
    """Compile every variant the sampler can launch before a request needs it (a compilation
    inside a step stalls it for about a second): the model's logits with the temperature
    applied in the kernel, and a float32 copy (after penalties or filters) with and without."""
    seeds = torch.zeros(1, dtype=torch.int64, device=device)
    temperature = torch.ones(1, dtype=torch.float32, device=device)
    for dtype, scale in ((logits_dtype, temperature), (torch.float32, temperature), (torch.float32, None)):
        # One row: split across the vocabulary, so the second pass compiles too.
        gumbel_max_sample(torch.zeros(1, vocab_size, dtype=dtype, device=device), seeds, scale)
