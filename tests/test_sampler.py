"""Sampler tests: each feature against a direct per-row computation (CPU).

Random rows sample with the torch Gumbel-max formula, or with the Triton kernel
(a Sampler built under use_triton_kernels, as on CUDA); tests taking the `sampler` fixture run both, the
kernel under Triton's interpreter (slow: about 30 ms per row, so those tests keep batches
and step counts small).
tests/test_sampling_kernel.py tests the kernel itself against the torch formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm.layers.custom_op import use_triton_kernels
from minivllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow, gumbel_noise
from minivllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 64
INF = float("inf")


def make_rows(params: list[SamplingParams], prompts: list[list[int]] | None = None,
              outputs: list[list[int]] | None = None,
              seeds: list[int | None] | None = None) -> list[SamplingRow]:
    n = len(params)
    prompts = prompts or [[1, 2, 3]] * n
    outputs = outputs or [[]] * n
    seeds = seeds or [None] * n
    return [SamplingRow(p, list(pr), list(out), seed)
            for p, pr, out, seed in zip(params, prompts, outputs, seeds)]


def build(rows: list[SamplingRow], vocab: int = V, output_position: int = 0) -> SamplingMetadata:
    """The rows' metadata, each row sampling this output position (what seeded rows' draws depend on)."""
    meta = SamplingMetadata.build(rows, vocab, CPU)
    return meta.at_output_positions(np.full(len(rows), output_position, dtype=np.int64))


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept(processed_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(processed_row)).flatten().tolist())


@pytest.fixture(params=["torch", "triton"])
def sampler(request: pytest.FixtureRequest) -> Sampler:
    """A sampler drawing random rows with the torch formula, or with the Triton kernel (as on
    CUDA)."""
    with use_triton_kernels(request.param == "triton"):
        return Sampler()


# --- direct per-row references ---------------------------------------------------------

def ref_min_p(row: torch.Tensor, min_p: float) -> set[int]:
    probs = row.softmax(-1)
    return {i for i in range(len(row)) if probs[i] >= min_p * probs.max()}


def ref_top_k(row: torch.Tensor, k: int) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    return set(order[:k])


def ref_top_p(row: torch.Tensor, allowed: set[int], p: float) -> set[int]:
    """Smallest most-likely-first set among `allowed` whose renormalised mass reaches p."""
    order = sorted(allowed, key=lambda i: -row[i].item())
    probs = torch.softmax(row[order], -1).tolist()
    keep, mass = set(), 0.0
    for token, prob in zip(order, probs):
        keep.add(token)
        mass += prob
        if mass >= p:
            break
    return keep


# --- greedy ----------------------------------------------------------------------------

def test_greedy_is_argmax_and_bf16_input_is_fine() -> None:
    logits = random_logits(5)
    rows = make_rows([SamplingParams(temperature=0.0) for _ in range(5)])
    meta = build(rows)
    assert meta.all_greedy and not meta.all_random
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None
    bf16 = logits.bfloat16()
    assert torch.equal(Sampler()(bf16, meta).sampled_token_ids, bf16.float().argmax(-1))


def test_greedy_rows_ignore_filters_and_mixed_batch() -> None:
    logits = random_logits(4)
    params = [SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.5),
              SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=1)]
    meta = build(make_rows(params))
    assert not meta.all_greedy and not meta.all_random
    assert meta.top_k.tolist() == [0, 1, 0, 1]  # greedy rows' filters are switched off
    out = Sampler()(logits, meta)
    # top_k=1 random rows are argmax too.
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_caller_logits_unchanged() -> None:
    logits = random_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=5, top_p=0.8, repetition_penalty=1.3,
                             min_tokens=2, stop_token_ids=[7])] * 3
    Sampler()(logits, build(make_rows(params)))
    assert torch.equal(logits, before)


# --- filters ---------------------------------------------------------------------------

FILTER_CASES = [
    {"top_k": 5}, {"top_k": 1}, {"top_k": V + 10}, {"top_p": 0.5}, {"top_p": 0.9},
    {"min_p": 0.1}, {"min_p": 0.02, "top_k": 10}, {"top_k": 8, "top_p": 0.6},
    {"top_k": 20, "top_p": 0.7, "min_p": 0.05}, {}, {"top_p": 0.999, "min_p": 0.3},
]


def reference_allowed(row: torch.Tensor, case: dict) -> set[int]:
    allowed = set(range(len(row)))
    if case.get("min_p"):
        allowed = ref_min_p(row, case["min_p"])
    if case.get("top_k"):
        allowed &= ref_top_k(row.masked_fill(
            torch.tensor([i not in allowed for i in range(len(row))]), -INF), case["top_k"])
    if case.get("top_p", 1.0) < 1.0:
        allowed = ref_top_p(row, allowed, case["top_p"])
    return allowed


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_filters_match_direct_computation(temperature: float) -> None:
    """All cases in one batch (mixing the top-k-only and full-sort paths), then each case
    alone (which may take the cheaper top-k path): both must match the reference."""
    logits = random_logits(len(FILTER_CASES), seed=1)
    params = [SamplingParams(temperature=temperature, **case) for case in FILTER_CASES]
    sampler = Sampler()
    batch_meta = build(make_rows(params))
    assert batch_meta.sort_full_vocab
    processed = sampler.processed_logits(logits, batch_meta)
    for i, case in enumerate(FILTER_CASES):
        scaled = logits[i] / temperature
        expected = reference_allowed(scaled, case)
        assert kept(processed[i]) == expected, case
        # Kept tokens keep their temperature-scaled logits exactly (no renormalisation).
        idx = sorted(expected)
        torch.testing.assert_close(processed[i, idx], scaled[idx], rtol=0, atol=0)
        alone = sampler.processed_logits(logits[i:i + 1], build(make_rows([params[i]])))
        assert kept(alone[0]) == expected, case


def test_top_p_restricted_to_top_k_candidates_avoids_full_sort() -> None:
    params = [SamplingParams(top_k=10, top_p=0.5), SamplingParams(top_k=3), SamplingParams()]
    meta = build(make_rows(params))
    assert not meta.sort_full_vocab and meta.max_top_k == 10
    assert meta.min_p is None
    logits = random_logits(3, seed=2)
    processed = Sampler().processed_logits(logits, meta)
    assert kept(processed[0]) == reference_allowed(logits[0], {"top_k": 10, "top_p": 0.5})
    assert kept(processed[1]) == ref_top_k(logits[1], 3)
    assert kept(processed[2]) == set(range(V))


def test_samples_stay_in_allowed_set() -> None:
    torch.manual_seed(0)
    case = {"top_k": 12, "top_p": 0.8, "min_p": 0.02}
    row = random_logits(1, seed=3)[0]
    n = 2000
    logits = row.expand(n, V).contiguous()
    meta = build(make_rows([SamplingParams(temperature=1.3, **case)] * n))
    sampled = Sampler()(logits, meta).sampled_token_ids
    allowed = reference_allowed(row / 1.3, case)
    assert set(sampled.tolist()) <= allowed
    assert len(set(sampled.tolist())) > 1


def test_temperature_frequencies_match_softmax() -> None:
    torch.manual_seed(1234)
    vocab, n, temperature = 8, 20_000, 0.7
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    meta = build(make_rows([SamplingParams(temperature=temperature)] * n), vocab)
    sampled = Sampler()(row.expand(n, vocab).contiguous(), meta).sampled_token_ids
    freq = torch.bincount(sampled, minlength=vocab).float() / n
    expected = torch.softmax(row / temperature, -1)
    # Std of a frequency is <= 0.0036 at n = 20k; 0.012 is over 3 sigma for every token.
    assert (freq - expected).abs().max() < 0.012, (freq, expected)


def chi_square(sampled: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the sampled tokens against probabilities
    `expected`, over the tokens expected at least 5 times (the rest must never appear)."""
    n = len(sampled)
    observed = torch.bincount(sampled, minlength=len(expected)).double()
    counts = expected.double() * n
    assert observed[counts == 0].sum() == 0, "sampled a token of probability 0"
    big = counts >= 5
    rest_obs, rest_exp = observed[~big & (counts > 0)].sum(), counts[~big & (counts > 0)].sum()
    stat = float(((observed[big] - counts[big]) ** 2 / counts[big]).sum())
    if rest_exp >= 5:
        stat += float((rest_obs - rest_exp) ** 2 / rest_exp)
    return stat, int(big.sum()) - (0 if rest_exp >= 5 else 1)


@pytest.mark.parametrize("case", [{"temperature": 1.3}, {"temperature": 0.8, "top_p": 0.9},
                                  {"temperature": 2.0, "min_p": 0.05}])
def test_chi_square_against_softmax(case: dict) -> None:
    """50k draws over a 40-token vocabulary (with and without filters, which take the
    pre-scaled path) against softmax(logits / T) over the tokens the reference filters
    keep. The statistic has mean df and std sqrt(2 df); df + 8 std has p < 1e-6, and a
    sampler off by a few percent on a likely token lands far above it."""
    torch.manual_seed(99)
    vocab, n = 40, 50_000
    row = random_logits(1, vocab, seed=11)[0] / 2
    params = SamplingParams(**case)
    meta = build(make_rows([params] * n), vocab)
    sampled = Sampler()(row.expand(n, vocab).contiguous(), meta).sampled_token_ids
    scaled = row / case["temperature"]
    dropped = torch.tensor([i not in reference_allowed(scaled, case) for i in range(vocab)])
    stat, df = chi_square(sampled, torch.softmax(scaled.double().masked_fill(dropped, -INF), -1))
    assert stat < df + 8 * math.sqrt(2 * df), (stat, df)


def test_gumbel_noise_distribution_and_tail() -> None:
    """gumbel_noise is Gumbel(0, 1): a KS test over 2**20 draws; and each word's value is the
    exact -log(-log(1 - w)) (float64) to float32 precision wherever w < 0.99, including the
    largest noise values (tiny words: the draws that win), which a float32 1 - w would
    coarsen. Near w = 1 (noise < -1.5, draws that never win) 1 - w is coarse by design."""
    bits = torch.randint(0, 2**32, (2**20,), generator=torch.Generator().manual_seed(0))
    g = gumbel_noise(bits).double().sort().values
    cdf = torch.exp(-torch.exp(-g))
    ecdf = torch.arange(1, len(g) + 1, dtype=torch.float64) / len(g)
    assert (cdf - ecdf).abs().max() < 1.63 / math.sqrt(len(g))  # KS at p = 0.01

    words = torch.cat([torch.arange(0, 64), torch.tensor([2**20, 3 << 24, 2**26, 2**31]),
                       torch.arange(2**32 - 64, 2**32), bits[:4096]])
    w = (words.double() + 0.5) / 2**32
    exact = -torch.log(-torch.log1p(-w))
    got = gumbel_noise(words).double()
    fine = w < 0.99
    torch.testing.assert_close(got[fine], exact[fine], rtol=2e-6, atol=2e-6)
    coarse = ~fine & (words < 2**32 - 1024)  # the last words round w to (or clamp it at) 1 - 2**-24
    torch.testing.assert_close(got[coarse], exact[coarse], rtol=0, atol=0.05)
    assert torch.isfinite(got).all() and got.max() < 23 and got.min() > -3
    assert got[0] > 22  # word 0: w = 2**-33, noise -log(2**-33) = 22.9
    assert got[1] < got[0] and got[2] < got[1]  # distinct steps at the top


def test_minus_inf_tokens_never_sampled(sampler: Sampler) -> None:
    """Only a few finite logits, all very low, under a high temperature: still only them."""
    n = 200 if not sampler.gumbel_max_sample.uses_triton else 6
    logits = torch.full((n, V), -INF)
    logits[:, [2, 40, 63]] = -80.0
    logits[::2, 41] = -90.0
    meta = build(make_rows([SamplingParams(temperature=5.0)] * n))
    sampled = sampler(logits, meta).sampled_token_ids
    assert set(sampled[1::2].tolist()) <= {2, 40, 63}
    assert set(sampled[::2].tolist()) <= {2, 40, 41, 63}


def test_unedited_logits_are_read_without_a_copy(sampler: Sampler,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No penalties, min_tokens or filters: greedy and temperature rows read the caller's
    (bf16) logits directly, and leave them unchanged."""
    def no_copy(*args: object) -> None:
        raise AssertionError("copied the logits")

    monkeypatch.setattr(Sampler, "penalised_logits", no_copy)
    logits = random_logits(4, seed=12).bfloat16()
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1e-4), SamplingParams(temperature=0.0, logprobs=1)]
    meta = build(make_rows(params))
    assert not meta.edits_logits
    sampled = sampler(logits, meta).sampled_token_ids
    assert torch.equal(logits, before)
    greedy = logits.float().argmax(-1)
    # Row 2's temperature is so low that the noise cannot overturn the argmax.
    assert sampled[[0, 2, 3]].tolist() == greedy[[0, 2, 3]].tolist()


# --- penalties -------------------------------------------------------------------------

def reference_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    row = row.clone()
    for t in range(len(row)):
        count = output.count(t)
        if t in prompt or count:
            r = p.repetition_penalty
            row[t] = row[t] / r if row[t] > 0 else row[t] * r
        row[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return row


def test_penalties_match_direct_computation() -> None:
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-1.2, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=0.8, presence_penalty=0.5, frequency_penalty=-0.4),
              SamplingParams()]
    prompts = [[1, 5, 5, 9], [2, 3], list(range(30)), [7, 8, 63], [4, 4, 4]]
    outputs = [[9, 10, 10], [3, 3, 3, 11], [], [0, 0, 7, 40, 40, 40], [4, 5]]
    logits = random_logits(len(params), seed=4)
    meta = build(make_rows(params, prompts, outputs))
    assert meta.output_token_ids is not None and meta.prompt_token_ids is not None
    # Rows without any penalty send no tokens; rows without repetition send no prompt.
    assert (meta.output_token_ids[4] == V).all()
    assert (meta.prompt_token_ids[1] == V).all() and (meta.prompt_token_ids[2] == V).all()
    penalised = Sampler().penalised_logits(logits, meta)
    for i, p in enumerate(params):
        expected = reference_penalties(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(penalised[i], expected, rtol=1e-6, atol=1e-6)


def test_penalty_token_ids_may_be_numpy_arrays() -> None:
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.2)] * 2
    prompts, outputs = [[1, 2, 2], [60]], [[3, 3], []]
    logits = random_logits(2, seed=10)
    as_lists = Sampler().penalised_logits(logits, build(make_rows(params, prompts, outputs)))
    rows = [SamplingRow(p, np.array(pr, dtype=np.int64), np.array(out, dtype=np.int64))
            for p, pr, out in zip(params, prompts, outputs)]
    assert torch.equal(Sampler().penalised_logits(logits, build(rows)), as_lists)


def test_penalties_apply_to_greedy_rows() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)]
    meta = build(make_rows(params, outputs=[[5]]))
    assert Sampler()(logits, meta).sampled_token_ids.item() == 6


def test_no_penalty_tensors_without_penalties() -> None:
    meta = build(make_rows([SamplingParams(top_k=3), SamplingParams(temperature=0.0)]))
    assert meta.output_token_ids is None and meta.prompt_token_ids is None
    assert meta.repetition_penalty is None and meta.frequency_penalty is None
    meta = build(make_rows([SamplingParams(frequency_penalty=0.5)]))
    assert meta.output_token_ids is not None and meta.prompt_token_ids is None


# --- min_tokens ------------------------------------------------------------------------

def test_min_tokens_blocks_stop_and_eos_until_reached() -> None:
    eos = {0, 1}
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0.0)]
    for p in params:
        p.all_stop_token_ids = set(eos) | set(p.stop_token_ids)
    outputs = [[9, 9], [9, 9, 9], [], []]
    logits = random_logits(4, seed=5)
    logits[:, 5] = 50.0  # the stop token would win everywhere
    logits[:, 0] = 40.0
    meta = build(make_rows(params, outputs=outputs))
    penalised = Sampler().penalised_logits(logits, meta)
    assert kept(penalised[0]) == set(range(V)) - {0, 1, 5}
    assert kept(penalised[1]) == set(range(V))  # reached min_tokens
    assert kept(penalised[2]) == set(range(V)) - {0, 1}
    assert kept(penalised[3]) == set(range(V))
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert sampled[0] not in {0, 1, 5} and sampled[1] == 5 and sampled[2] == 5 and sampled[3] == 5


# --- logprobs --------------------------------------------------------------------------

def test_logprobs_are_raw_with_topk_and_rank() -> None:
    torch.manual_seed(3)
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=1.5, logprobs=0, top_k=7),
              SamplingParams(temperature=0.8, logprobs=5, presence_penalty=1.0, top_p=0.9),
              SamplingParams(temperature=1.0)]
    logits = random_logits(4, seed=6).bfloat16()
    meta = build(make_rows(params, outputs=[[1, 2]] * 4))
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits.float(), -1)
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = out.logprobs[:, 1:]
    assert (top[:, :-1] >= top[:, 1:]).all()
    torch.testing.assert_close(top, raw.topk(5, -1).values)
    for i in range(4):
        expected_rank = int((raw[i] >= raw[i, sampled[i]]).sum())
        assert out.sampled_token_ranks[i].item() == expected_rank


def test_rank_is_one_for_plain_greedy_and_logprobs_zero_is_one_column() -> None:
    logits = random_logits(3, seed=7)
    meta = build(make_rows([SamplingParams(temperature=0.0, logprobs=0)] * 3))
    out = Sampler()(logits, meta)
    assert out.sampled_token_ranks.tolist() == [1, 1, 1]
    assert out.logprob_token_ids.shape == (3, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).max(-1).values)


# --- seeds -----------------------------------------------------------------------------

def step_logits(step: int) -> torch.Tensor:
    """The seeded request's logits at each step: fixed, flat enough that sampling varies."""
    return torch.randn(V, generator=torch.Generator().manual_seed(100 + step))


def run_seeded(sampler: Sampler, position: int, others: list[SamplingParams], steps: int,
               seed: int, params: SamplingParams) -> list[int]:
    noise = torch.Generator().manual_seed(1000 + position)  # different neighbours each run
    tokens = []
    for step in range(steps):
        batch_params = list(others)
        batch_params.insert(position, params)
        seeds: list[int | None] = [None] * len(batch_params)
        seeds[position] = seed
        logits = torch.randn(len(batch_params), V, generator=noise) * 2
        logits[position] = step_logits(step)
        meta = build(make_rows(batch_params, seeds=seeds), output_position=step)
        tokens.append(sampler(logits, meta).sampled_token_ids[position].item())
    return tokens


@pytest.mark.parametrize("top_k", [40, 0])  # the pre-scaled (filtered) path, and the plain one
def test_seeded_rows_reproducible_and_batch_independent(sampler: Sampler, top_k: int) -> None:
    params = SamplingParams(temperature=1.0, seed=42, top_k=top_k)
    steps = 30 if not sampler.gumbel_max_sample.uses_triton else 5
    reference = run_seeded(sampler, 0, [], steps, 42, params)
    assert len(set(reference)) > steps // 2  # it really samples
    compositions = [
        (0, [SamplingParams(temperature=0.0)] * 3),
        (2, [SamplingParams(temperature=0.5), SamplingParams(top_p=0.3), SamplingParams()]),
        (1, [SamplingParams(min_p=0.2, logprobs=2), SamplingParams(temperature=0.0)]),
        (4, [SamplingParams(top_k=3)] * 6),
    ]
    if sampler.gumbel_max_sample.uses_triton:
        compositions = compositions[1:3]  # the interpreter is slow
    for position, others in compositions:
        torch.manual_seed(position)  # the unseeded rows' RNG state must not matter
        assert run_seeded(sampler, position, others, steps, 42, params) == reference
    assert run_seeded(sampler, 0, [], steps, 43, params) != reference


def test_a_seeded_draw_depends_on_the_seed_and_output_position_only(sampler: Sampler) -> None:
    """The same (seed, position) draws the same token in any row of any step, beside rows of
    other seeds and positions (a verify step samples several positions of one sequence);
    another position draws anew."""
    row = torch.zeros(V)  # uniform: the token is the noise's argmax
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sampler(row[None], build(make_rows([params], seeds=[7]), output_position=p)).sampled_token_ids.item()
             for p in range(6)]
    assert len(set(alone)) > 2
    meta = SamplingMetadata.build(make_rows([params] * 4, seeds=[7, 8, 7, 7]), V, CPU)
    sampled = sampler(row.expand(4, V), meta.at_output_positions(np.array([3, 3, 4, 5]))).sampled_token_ids
    assert [sampled[0].item(), *sampled[2:].tolist()] == alone[3:]


def test_two_rows_same_seed_same_tokens(sampler: Sampler) -> None:
    row = random_logits(1, seed=8)[0]
    logits = torch.stack([row, random_logits(1, seed=9)[0], row])
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    tokens = []
    for step in range(20 if not sampler.gumbel_max_sample.uses_triton else 4):
        sampled = sampler(logits, build(make_rows(params, seeds=[7, None, 7]), output_position=step)).sampled_token_ids
        assert sampled[0] == sampled[2]
        tokens.append(sampled[0].item())
    assert len(set(tokens)) > 1


def test_unseeded_rows_differ_and_seeded_batches_leave_the_default_rng(sampler: Sampler) -> None:
    logits = torch.zeros(4, V)  # uniform: every row's token is its noise's argmax
    params = [SamplingParams()] * 4
    sampled = sampler(logits, build(make_rows(params))).sampled_token_ids
    assert len(set(sampled.tolist())) > 1
    state = torch.get_rng_state()
    sampler(logits, build(make_rows([SamplingParams(seed=1)] * 4, seeds=[1, 2, 3, 4])))
    assert torch.equal(torch.get_rng_state(), state)


def test_greedy_rows_are_not_seeded_rows() -> None:
    meta = build(make_rows([SamplingParams(temperature=0.0, seed=5), SamplingParams()], seeds=[5, None]))
    assert meta.seeded is None


def test_metadata_float_fields() -> None:
    params = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=0.25, min_p=0.1)]
    meta = build(make_rows(params))
    assert meta.temperature.dtype == torch.float32
    assert meta.temperature.tolist() == [1.0, 0.25]
    assert meta.top_p is None  # only the greedy row asked for it
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert meta.greedy_mask.tolist() == [True, False]
    assert math.isclose(meta.min_p[1].item(), 0.1, rel_tol=1e-6)


# --- logit_bias and allowed_token_ids --------------------------------------------------

def test_logit_bias_moves_the_argmax_as_logits_plus_bias() -> None:
    """Greedy rows take the argmax of logits + bias (keys may repeat across rows); a plain row
    in the same batch keeps its own logits exactly."""
    logits = random_logits(4, seed=20)
    biases: list[dict[int, float]] = [{3: 30.0}, {3: -30.0, 7: 2.5, int(logits[1].argmax()): -4.0}, {},
                                      {63: 0.75}]
    params = [SamplingParams(temperature=0.0, logit_bias=b or None) for b in biases]
    meta = build(make_rows(params))
    assert meta.edits_logits and meta.logit_bias_rows is not None
    expected = logits.clone()
    for i, bias in enumerate(biases):
        for token, value in bias.items():
            expected[i, token] += value
    edited = Sampler().penalised_logits(logits, meta)
    assert torch.equal(edited, expected)
    assert torch.equal(Sampler()(logits, meta).sampled_token_ids, expected.argmax(-1))
    assert torch.equal(edited[2], logits[2])


def test_allowed_token_ids_with_bias_penalties_temperature_and_top_k(sampler: Sampler) -> None:
    """vLLM's order: the allowed-ids mask, then bias, then penalties, then temperature and top-k;
    greedy and random rows only ever pick allowed tokens."""
    allowed = [[3, 5, 7], [10, 11, 12, 13], [0, 63], [2, 40]]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed[0], presence_penalty=1.5),
              SamplingParams(temperature=0.7, top_k=2, allowed_token_ids=allowed[1], logit_bias={12: 3.0}),
              SamplingParams(temperature=1.3, allowed_token_ids=allowed[2], frequency_penalty=0.5,
                             logit_bias={63: -1.0, 5: 50.0}),
              SamplingParams(temperature=5.0, allowed_token_ids=allowed[3])]
    prompts = [[1, 2], [3], [4], [5]]
    outputs = [[5, 5], [], [63, 1], []]
    logits = random_logits(len(params), seed=21)
    meta = build(make_rows(params, prompts, outputs))
    processed = sampler.processed_logits(logits, meta)
    for i, p in enumerate(params):
        row = torch.full((V,), -INF)
        row[allowed[i]] = logits[i, allowed[i]]
        for token, value in (p.logit_bias or {}).items():
            row[token] += value
        row = reference_penalties(row, p, prompts[i], outputs[i])
        if p.temperature > 0:
            row = row / p.temperature
        if p.top_k:
            row[sorted(set(range(V)) - ref_top_k(row, p.top_k))] = -INF
        torch.testing.assert_close(processed[i], row, rtol=1e-6, atol=1e-6)
    assert kept(processed[2]) == {0, 63}  # the bias on 5 does not lift a masked-out token
    steps = 5 if sampler.gumbel_max_sample.uses_triton else 200
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(steps):
        for i, token in enumerate(sampler(logits, meta).sampled_token_ids.tolist()):
            seen[i].add(token)
    assert seen[0] == {int(processed[0].argmax())}
    for i in range(1, len(params)):
        assert seen[i] <= set(allowed[i]), (i, seen[i])
    if not sampler.gumbel_max_sample.uses_triton:
        assert seen[3] == set(allowed[3])  # temperature 5 over two allowed tokens: both come up


def test_no_bias_or_mask_tensors_without_them() -> None:
    meta = build(make_rows([SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)]))
    assert meta.logit_bias_rows is None and meta.logit_bias_values is None
    assert meta.allowed_rows is None and meta.disallowed_mask is None
    assert not meta.edits_logits
    meta = build(make_rows([SamplingParams(), SamplingParams(allowed_token_ids=[4]), SamplingParams()]))
    assert meta.allowed_rows is not None and meta.allowed_rows.tolist() == [1]
    assert meta.disallowed_mask is not None and meta.disallowed_mask.shape == (1, V)
    assert meta.logit_bias_rows is None
