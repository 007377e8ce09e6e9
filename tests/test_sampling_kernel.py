"""The Gumbel-max sampling kernel (minivllm/kernels/sampling.py) against the torch formula.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), about
30 ms per program, so shapes stay small. The reference regenerates the kernel's noise
with Philox4x32-10 in numpy: token j of a row with seed s takes word j % 4 of counter
j // 4 under key s. The sampling statistics of the formula itself are tested in torch
(tests/test_sampler.py), where millions of draws are cheap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.kernels import sampling
from minivllm.layers.sampler import gumbel_noise
from tests.conftest import requires_cuda

INF = float("inf")

_MASK32 = np.uint64(0xFFFFFFFF)


def philox_words(seed: int, num_tokens: int) -> torch.Tensor:
    """The kernel's 32-bit word for tokens 0..num_tokens-1 under key `seed`, as int64."""
    c0 = np.arange((num_tokens + 3) // 4, dtype=np.uint64)
    c1, c2, c3 = np.zeros_like(c0), np.zeros_like(c0), np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # < 2**64: no wrap
        c0, c2 = ((p2 >> np.uint64(32)) ^ c1 ^ k0) & _MASK32, ((p0 >> np.uint64(32)) ^ c3 ^ k1) & _MASK32
        c1, c3 = p2 & _MASK32, p0 & _MASK32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK32, (k1 + np.uint64(0xBB67AE85)) & _MASK32
    words = np.stack([c0, c1, c2, c3], axis=1).reshape(-1)[:num_tokens]
    return torch.from_numpy(words.astype(np.int64))


def reference_scores(logits: torch.Tensor, seeds: torch.Tensor,
                     temperature: torch.Tensor | None) -> torch.Tensor:
    noise = torch.stack([gumbel_noise(philox_words(int(s), logits.shape[1])) for s in seeds])
    if temperature is not None:
        noise = noise * temperature.unsqueeze(1)
    return logits.float() + noise


def assert_is_argmax(sampled: torch.Tensor, scores: torch.Tensor) -> None:
    """The kernel's token has the top reference score (up to the last bits of a log: numpy's
    in the interpreter, torch's in the reference)."""
    picked = scores.gather(1, sampled.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(picked, scores.max(dim=1).values, rtol=0, atol=1e-5)


def test_philox_words_match_triton() -> None:
    """The reference's noise source is the kernel's: with all logits equal, the kernel's
    token is the argmax of the reference noise, exactly. Each of the 16 rows (keys with
    and without high bits) would match by chance with probability 1/256 if the kernel
    drew other words: all of them, 2**-128."""
    vocab = 256  # 64 Philox counters, all four words of each
    seeds = torch.tensor([0, 1, 7, 2**32 - 1, 2**32, 0x1234_5678_9ABC_DEF, 2**63 - 1]
                         + [(2**61 + 977 * i) * (1 + i % 3) for i in range(9)], dtype=torch.int64)
    noise = torch.stack([gumbel_noise(philox_words(int(s), vocab)) for s in seeds])
    sampled = sampling.gumbel_max_sample(torch.zeros(len(seeds), vocab), seeds)
    assert sampled.tolist() == noise.argmax(dim=1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_temperature", [False, True])
def test_kernel_matches_torch_formula(dtype: torch.dtype, with_temperature: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 1000, generator=gen) * 2).to(dtype)
    logits[1, ::3] = -INF  # filtered tokens
    logits[2, 100:] = -INF
    seeds = torch.tensor([0, 2**62 + 12345, 987654321], dtype=torch.int64)
    temperature = torch.tensor([0.5, 1.0, 3.0]) if with_temperature else None
    sampled = sampling.gumbel_max_sample(logits, seeds, temperature)
    assert sampled.dtype == torch.int64 and sampled.shape == (3,)
    assert_is_argmax(sampled, reference_scores(logits, seeds, temperature))
    assert sampled[1] % 3 != 0 and sampled[2] < 100


def test_noise_depends_on_seed_and_token_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tokens whatever the launch configuration (chunk size, number of vocabulary
    splits, splits per iteration of the second pass), the row's position, the batch around
    it, or a strided view of the logits."""
    vocab = 500
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=gen)
    seeds = torch.tensor([11, 22, 33, 44])
    expected = sampling.gumbel_max_sample(logits, seeds)
    assert_is_argmax(expected, reference_scores(logits, seeds, None))
    for block, splits, reduce_block in [(32, 6, 4), (64, 3, 128), (256, 2, 1)]:
        monkeypatch.setattr(sampling, "_launch_config", lambda b, v, d, c=(block, splits, 4): c)
        monkeypatch.setattr(sampling, "_REDUCE_BLOCK", reduce_block)
        assert torch.equal(sampling.gumbel_max_sample(logits, seeds), expected), (block, splits)
    monkeypatch.undo()
    # Row 2 alone, then inside a different batch at another position.
    assert sampling.gumbel_max_sample(logits[2:3], seeds[2:3]).item() == expected[2]
    other = torch.randn(2, vocab, generator=gen)
    batch = torch.cat([other[:1], logits[2:3], other[1:]])
    assert sampling.gumbel_max_sample(batch, torch.tensor([5, 33, 6]))[1] == expected[2]
    padded = torch.zeros(4, vocab + 50)
    padded[:, :vocab] = logits
    assert torch.equal(sampling.gumbel_max_sample(padded[:, :vocab], seeds), expected)


@pytest.mark.parametrize(("splits", "reduce_block"), [(1, 128), (4, 128), (4, 2)])
def test_minus_inf_never_picked_and_ties_go_to_the_first(monkeypatch: pytest.MonkeyPatch,
                                                         splits: int, reduce_block: int) -> None:
    monkeypatch.setattr(sampling, "_launch_config", lambda b, v, d: (64, splits, 4))
    monkeypatch.setattr(sampling, "_REDUCE_BLOCK", reduce_block)
    vocab = 256
    logits = torch.full((4, vocab), -INF)
    logits[0, [3, 130, 255]] = -40.0  # very unlikely tokens, but the only finite ones
    logits[1, [200, 60]] = INF  # equal scores (inf + noise): the first index wins
    logits[2] = 0.0
    logits[2, 17] = 1e4  # certain whatever the noise
    # Row 3: nothing finite at all; answers token 0 rather than garbage.
    for seed in range(3):
        seeds = torch.tensor([seed, seed + 10, seed + 20, seed + 30])
        sampled = sampling.gumbel_max_sample(logits, seeds, torch.tensor([5.0, 1.0, 1.0, 1.0]))
        assert sampled[0].item() in {3, 130, 255}
        assert sampled[1:].tolist() == [60, 17, 0]


def test_greedy_limit_and_empty_batch() -> None:
    """A tiny temperature makes the noise irrelevant (the argmax); zero rows are fine."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    sampled = sampling.gumbel_max_sample(logits, torch.tensor([1, 2, 3]), torch.full((3,), 1e-6))
    assert torch.equal(sampled, logits.argmax(dim=1))
    empty = sampling.gumbel_max_sample(torch.empty(0, 300), torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_launch_config_fills_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small batches split the vocabulary so that every SM has work; large ones do not."""
    monkeypatch.setattr(sampling, "sm_count", lambda device: 132)  # an H200, without a GPU
    cuda = torch.device("cuda", 0)
    block, splits_1, _ = sampling._launch_config(1, 151_936, cuda)
    _, splits_256, _ = sampling._launch_config(256, 151_936, cuda)
    _, splits_tiny, _ = sampling._launch_config(1, 64, cuda)
    assert block % 4 == 0 and 40 <= splits_1 <= 4 * 132
    assert 256 * splits_256 >= 2 * 132 and splits_256 <= 4
    assert splits_tiny == 1


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_torch_formula(dtype: torch.dtype) -> None:
    """Compiled, the kernel takes its logs from the GPU's approximate log2 (relative error
    ~2**-22): its token still has the top reference score, to that error, at W1's shape
    (256 rows over Qwen3's 151,936-token vocabulary, three splits per row)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(256, 151_936, generator=gen) * 3).to(dtype)
    seeds = torch.randint(0, 2**62, (256,), generator=gen)
    temperature = torch.rand(256, generator=gen) + 0.3
    sampled = sampling.gumbel_max_sample(logits.cuda(), seeds.cuda(), temperature.cuda()).cpu()
    scores = reference_scores(logits, seeds, temperature)
    picked = scores.gather(1, sampled.unsqueeze(1)).squeeze(1)
    # |G| <= 22.9 and each log is off by ~2**-22 relatively: 1e-4 covers both logs at T < 1.3.
    torch.testing.assert_close(picked, scores.max(dim=1).values, rtol=0, atol=1e-4)
