"""The two-level Gumbel-max sampling kernels (minivllm/kernels/sampling.py) against the torch formula.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), about
30 ms per program, so shapes stay small; most tests cut the vocabulary into 64-token chunks
(the engine's are 2,048) so that both levels have several candidates. The reference
regenerates the kernels' noise with Philox4x32-10 in numpy: token j of a row with seed s
takes word j % 4 of counter (j // 4, 0) under key s, chunk c word 0 of counter (c, 1).
The sampling statistics of the token-level formula are tested in torch
(tests/test_sampler.py), those of the two levels here, where millions of draws are cheap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.kernels import sampling
from minivllm.layers.sampler import gumbel_noise

INF = float("inf")
TEST_CHUNK = 64

_MASK32 = np.uint64(0xFFFFFFFF)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "_CHUNK", TEST_CHUNK)


def philox_words(seed: int, num_words: int, counter_hi: int = 0) -> torch.Tensor:
    """Words 0..num_words-1 of Philox4x32-10 under key `seed`, word i being word i % 4 of
    counter (i // 4, counter_hi), as int64."""
    c0 = np.arange((num_words + 3) // 4, dtype=np.uint64)
    c1, c2, c3 = np.full_like(c0, counter_hi), np.zeros_like(c0), np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # < 2**64: no wrap
        c0, c2 = ((p2 >> np.uint64(32)) ^ c1 ^ k0) & _MASK32, ((p0 >> np.uint64(32)) ^ c3 ^ k1) & _MASK32
        c1, c3 = p2 & _MASK32, p0 & _MASK32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK32, (k1 + np.uint64(0xBB67AE85)) & _MASK32
    words = np.stack([c0, c1, c2, c3], axis=1).reshape(-1)[:num_words]
    return torch.from_numpy(words.astype(np.int64))


def chunk_noise(seed: int, num_chunks: int) -> torch.Tensor:
    return gumbel_noise(philox_words(seed, 4 * num_chunks, counter_hi=1)[::4])


def reference_chunk_scores(logits: torch.Tensor, seeds: torch.Tensor,
                           temperature: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """[B, num_chunks] float64: logsumexp(logits / T) over each chunk plus its noise."""
    num_rows, vocab = logits.shape
    num_chunks = -(-vocab // chunk)
    scaled = torch.full((num_rows, num_chunks * chunk), -INF, dtype=torch.float64)
    scaled[:, :vocab] = logits.double() / (1.0 if temperature is None else temperature.double().unsqueeze(1))
    lse = scaled.view(num_rows, num_chunks, chunk).logsumexp(dim=2)
    return lse + torch.stack([chunk_noise(int(s), num_chunks) for s in seeds]).double()


def reference_token_scores(logits: torch.Tensor, seeds: torch.Tensor,
                           temperature: torch.Tensor | None) -> torch.Tensor:
    """[B, V] float32: logits + T * G, G the per-token noise."""
    noise = torch.stack([gumbel_noise(philox_words(int(s), logits.shape[1])) for s in seeds])
    if temperature is not None:
        noise = noise * temperature.unsqueeze(1)
    return logits.float() + noise


def assert_top(picked: torch.Tensor, scores: torch.Tensor, atol: float) -> None:
    """Each row's picked index has the row's top score (up to the last bits of the logs and
    exps: numpy's or the GPU's in the kernels, torch's in the reference)."""
    torch.testing.assert_close(scores.gather(1, picked.unsqueeze(1)).squeeze(1), scores.max(dim=1).values,
                               rtol=0, atol=atol)


def assert_two_level_sample(sampled: torch.Tensor, logits: torch.Tensor, seeds: torch.Tensor,
                            temperature: torch.Tensor | None, chunk: int, atol: float = 1e-5) -> None:
    """The kernels' token lies in the top-scoring chunk and has the top score within it."""
    assert sampled.dtype == torch.int64 and sampled.shape == (logits.shape[0],)
    picked_chunk = sampled // chunk
    assert_top(picked_chunk, reference_chunk_scores(logits, seeds, temperature, chunk), atol)
    tokens = reference_token_scores(logits, seeds, temperature)
    vocab = torch.arange(logits.shape[1])
    tokens[(vocab // chunk).unsqueeze(0) != picked_chunk.unsqueeze(1)] = -INF  # other chunks
    assert_top(sampled, tokens, atol)


@pytest.mark.slow  # Triton's own Philox in its interpreter, over many words
def test_philox_words_match_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's noise sources are the kernels': with all logits equal, the chunk is
    the argmax of the reference's chunk noise and the token the argmax of its token noise
    within that chunk, exactly. Each of the 16 rows (keys with and without high bits) would
    match by chance with probability 1/256 if the kernels drew other words: all of them,
    2**-128. One chunk of 256 tokens first (the token level alone), then 64 chunks of 4."""
    vocab = 256  # 64 Philox counters, all four words of each
    seeds = torch.tensor([0, 1, 7, 2**32 - 1, 2**32, 0x1234_5678_9ABC_DEF, 2**63 - 1]
                         + [(2**61 + 977 * i) * (1 + i % 3) for i in range(9)], dtype=torch.int64)
    logits = torch.zeros(len(seeds), vocab)
    token_noise = torch.stack([gumbel_noise(philox_words(int(s), vocab)) for s in seeds])
    assert sampling.gumbel_max_sample(logits, seeds).tolist() == token_noise.argmax(dim=1).tolist()

    monkeypatch.setattr(sampling, "_CHUNK", 4)
    chunks = torch.stack([chunk_noise(int(s), vocab // 4) for s in seeds]).argmax(dim=1)
    expected = 4 * chunks + token_noise.view(len(seeds), vocab // 4, 4)[torch.arange(len(seeds)), chunks].argmax(dim=1)
    assert sampling.gumbel_max_sample(logits, seeds).tolist() == expected.tolist()


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_temperature", [False, True])
def test_kernel_matches_torch_formula(dtype: torch.dtype, with_temperature: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 1000, generator=gen) * 2).to(dtype)  # 16 chunks, the last one partial
    logits[1, ::3] = -INF  # filtered tokens
    logits[2, 100:] = -INF
    seeds = torch.tensor([0, 2**62 + 12345, 987654321], dtype=torch.int64)
    temperature = torch.tensor([0.5, 1.0, 3.0]) if with_temperature else None
    sampled = sampling.gumbel_max_sample(logits, seeds, temperature)
    assert_two_level_sample(sampled, logits, seeds, temperature, TEST_CHUNK)
    assert sampled[1] % 3 != 0 and sampled[2] < 100


@pytest.mark.usefixtures("small_chunks")
def test_sample_depends_on_seed_and_logits_only() -> None:
    """The same tokens whatever the row's position, the batch around it, or a strided view
    of the logits."""
    vocab = 500
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=gen)
    seeds = torch.tensor([11, 22, 33, 44])
    expected = sampling.gumbel_max_sample(logits, seeds)
    assert_two_level_sample(expected, logits, seeds, None, TEST_CHUNK)
    # Row 2 alone, then inside a different batch at another position.
    assert sampling.gumbel_max_sample(logits[2:3], seeds[2:3]).item() == expected[2]
    other = torch.randn(2, vocab, generator=gen)
    batch = torch.cat([other[:1], logits[2:3], other[1:]])
    assert sampling.gumbel_max_sample(batch, torch.tensor([5, 33, 6]))[1] == expected[2]
    padded = torch.zeros(4, vocab + 50)
    padded[:, :vocab] = logits
    assert torch.equal(sampling.gumbel_max_sample(padded[:, :vocab], seeds), expected)


@pytest.mark.parametrize("chunk", [TEST_CHUNK, 2048])
def test_minus_inf_never_picked_and_ties_go_to_the_first(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(sampling, "_CHUNK", chunk)
    vocab = 256
    logits = torch.full((5, vocab), -INF)
    logits[0, [3, 130, 255]] = -40.0  # very unlikely tokens, but the only finite ones
    logits[1, [200, 60]] = INF  # equal scores (inf + noise): the first index wins
    logits[2] = 0.0
    logits[2, 17] = 1e4  # certain whatever the noise
    # Row 3: nothing finite at all, row 4 NaN (a broken model): token 0 rather than garbage.
    logits[4] = float("nan")
    for seed in range(3):
        seeds = torch.tensor([seed, seed + 10, seed + 20, seed + 30, seed + 40])
        sampled = sampling.gumbel_max_sample(logits, seeds, torch.tensor([5.0, 1.0, 1.0, 1.0, 1.0]))
        assert sampled[0].item() in {3, 130, 255}
        assert sampled[1:].tolist() == [60, 17, 0, 0]


@pytest.mark.usefixtures("small_chunks")
def test_greedy_limit_and_empty_batch() -> None:
    """A tiny temperature makes the noise irrelevant (the argmax); zero rows are fine."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    sampled = sampling.gumbel_max_sample(logits, torch.tensor([1, 2, 3]), torch.full((3,), 1e-6))
    assert torch.equal(sampled, logits.argmax(dim=1))
    empty = sampling.gumbel_max_sample(torch.empty(0, 300), torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_two_levels_sample_the_softmax() -> None:
    """The kernels' method, chunk by logsumexp + Gumbel then token by Gumbel-max within the
    chunk, in torch with 400,000 draws over 12 tokens in chunks of 4 (one chunk with a -inf
    token, one much less likely than the rest): every token's frequency within 5 standard
    errors of softmax(logits / T), and the -inf token never drawn."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0, -INF, 1.5, 1.5, -0.5, -3.0, -4.0, -2.5, -3.5], dtype=torch.float64)
    temperature, draws, chunk = 0.7, 400_000, 4
    scaled = (logits / temperature).view(-1, chunk)

    def gumbel(*shape: int) -> torch.Tensor:
        return -torch.empty(*shape, dtype=torch.float64).exponential_(generator=gen).log()

    chunks = (scaled.logsumexp(dim=1) + gumbel(draws, scaled.shape[0])).argmax(dim=1)
    tokens = chunk * chunks + (scaled[chunks] + gumbel(draws, chunk)).argmax(dim=1)
    freq = torch.bincount(tokens, minlength=logits.numel()).double() / draws
    probs = (logits / temperature).softmax(dim=0)
    assert freq[4] == 0
    assert ((freq - probs).abs() <= 5 * (probs * (1 - probs) / draws).sqrt() + 1e-12).all(), (freq, probs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_torch_formula(dtype: torch.dtype) -> None:
    """Compiled, the kernels take their logs and exps from the GPU's approximate log2 and
    exp2 (relative error ~2**-22): the token still lies in the top reference chunk and has
    the top reference score within it, to that error, at W1's shape (256 rows over Qwen3's
    151,936-token vocabulary: 75 chunks a row)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(256, 151_936, generator=gen) * 3).to(dtype)
    seeds = torch.randint(0, 2**62, (256,), generator=gen)
    temperature = torch.rand(256, generator=gen) + 0.3
    sampled = sampling.gumbel_max_sample(logits.cuda(), seeds.cuda(), temperature.cuda()).cpu()
    # |G| <= 22.9 and each log is off by ~2**-22 relatively: 1e-4 covers both logs at T < 1.3
    # (and the chunks' logsumexp of logits / T, below ~40).
    assert_two_level_sample(sampled, logits, seeds, temperature, sampling._CHUNK, atol=1e-4)
