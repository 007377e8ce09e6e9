"""Speculative decoding with ngram drafts: greedy output is the model's own (HF's, and the
engine's without speculation), sampling keeps the target distribution, and every sampling
parameter and stop condition acts on each verified token as on a decoded one.

The model has a 16-token vocabulary: its greedy continuations fall into loops, so prompt
lookup finds drafts that are often right and often wrong."""

import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.engine.metrics import ServingMetrics
from minivllm.engine.ngram_proposer import find_draft
from minivllm.entrypoints.cli import main
from minivllm.sampling_params import StructuredOutputsParams
from tests.hf_oracle import hf_greedy, load_hf_model

VOCAB_SIZE = 16
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM", vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def spec_llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128, block_size=8, speculative_config=SPEC)


@pytest.fixture(scope="module")
def plain_llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128, block_size=8)


def random_prompt(length: int, seed: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def accepted_tokens(llm: LLM) -> int:
    return llm.llm_engine.stats()["spec_decode_num_accepted_tokens"]


def test_find_draft_is_the_earliest_longest_match() -> None:
    tokens = np.array([7, 2, 3, 8, 1, 2, 3, 9, 4, 2, 3, 5, 6, 1, 2, 3])
    # 2 3 occurred at 1..2 (then 8); 1 2 3 at 4..6 (then 9): the longer match wins.
    assert find_draft(tokens, 1, 3, 2).tolist() == [9, 4]
    assert find_draft(tokens, 1, 2, 2).tolist() == [8, 1]  # 2 3: the earliest occurrence
    assert find_draft(tokens, 4, 4, 2).tolist() == []  # 8 1 2 3 ... no 4-token match
    assert find_draft(np.array([4, 4, 4, 4, 4]), 2, 2, 3).tolist() == [4, 4, 4]  # overlapping the suffix
    rng = np.random.default_rng(0)
    for _ in range(300):  # against the definition, by brute force
        tokens = rng.integers(0, 3, int(rng.integers(1, 30)))
        min_n, max_n, k = int(rng.integers(1, 3)), int(rng.integers(3, 5)), int(rng.integers(1, 4))
        want: list[int] = []
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            ends = [j for j in range(n - 1, len(tokens) - 1)
                    if tokens[j - n + 1:j + 1].tolist() == tokens[len(tokens) - n:].tolist()]
            if ends:
                want = tokens[ends[0] + 1:ends[0] + 1 + k].tolist()
                break
        assert find_draft(tokens, min_n, max_n, k).tolist() == want


def test_config_as_vllm_takes_it(model_dir: str, capsys: pytest.CaptureFixture) -> None:
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    for values, message in [({"num_speculative_tokens": 2, "draft_model": "x"}, "no key 'draft_model'"),
                            ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
                            ({"method": "ngram"}, "needs num_speculative_tokens"),
                            ({"num_speculative_tokens": 0}, "at least 1"),
                            ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                             "must not exceed")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(values)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", model_dir, "--speculative-config", '{"method": "eagle"}'])
    assert exit_info.value.code == 2 and "method 'eagle'" in capsys.readouterr().err


@pytest.mark.parametrize("spec", [SPEC, {"method": "suffix", "num_speculative_tokens": 3}], ids=["ngram", "suffix"])
def test_greedy_is_hf_with_cache_hits_chunked_prefill_and_preemption(model_dir: str, spec: dict) -> None:
    """Drafts verified in steps that also run prompt chunks; prompts sharing blocks; a cache
    so small that sequences are preempted and recomputed, drafts and all."""
    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=40, max_num_seqs=6, speculative_config=spec)
    shared = random_prompt(12, seed=1)
    prompts = [shared + random_prompt(9, seed=2), shared + random_prompt(5, seed=3), random_prompt(23, seed=4),
               random_prompt(7, seed=5), shared + random_prompt(9, seed=2), random_prompt(30, seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 48)[0]
    stats = llm.llm_engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # some rejected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    per_position = [stats[f"spec_decode_num_accepted_tokens_pos{i}"] for i in range(3)]
    assert sum(per_position) == stats["spec_decode_num_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # a position is reached only past the ones before


def test_grammar_guided_rows_take_drafts_their_grammar_checks(spec_llm: LLM, plain_llm: LLM, model_dir: str) -> None:
    """Guided rows take drafts too: each of their positions is masked by the grammar's state
    after the drafts before it (rows with drafts before them shift those positions), and a
    draft the grammar refuses is never kept; the output is the one without speculation."""
    prompts = [random_prompt(6, seed=s) * 3 for s in range(6)]
    # Outputs that repeat themselves (their drafts accepted), and ones drafted from prompts whose
    # tokens the grammar refuses.
    regex = StructuredOutputsParams(regex="(!#){5,8}\\$")
    alternating = StructuredOutputsParams(regex="(%#|#%)(%#|#%|%%#)*,")
    guided = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so) for so in (regex, alternating)]
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [free, guided[0], free, guided[1], guided[0], guided[1]]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    accepted_before = accepted_tokens(spec_llm)
    outputs = spec_llm.generate(inputs, params, use_tqdm=False)
    assert accepted_tokens(spec_llm) > accepted_before
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        list(o.outputs[0].token_ids) for o in plain_llm.generate(inputs, params, use_tqdm=False)]
    for i in (0, 2):
        assert list(outputs[i].outputs[0].token_ids) == hf_greedy(model_dir, prompts[i], 40)[0]
    for i in (1, 4):
        text = outputs[i].outputs[0].text
        assert text.startswith("!#") and text.endswith("$") and set(text) <= set("!#$"), text
    # Guided requests alone: their own drafts are verified and accepted.
    accepted_before = accepted_tokens(spec_llm)
    alone = spec_llm.generate([inputs[1], inputs[4]], [guided[0], guided[0]], use_tqdm=False)
    assert accepted_tokens(spec_llm) > accepted_before
    assert [o.outputs[0].text for o in alone] == [outputs[1].outputs[0].text, outputs[4].outputs[0].text]
    # Sampled and seeded: each position's draw and mask as without speculation.
    seeded = SamplingParams(temperature=1.0, max_tokens=24, seed=5, structured_outputs=alternating)
    assert ([o.outputs[0].text for o in spec_llm.generate(inputs[3:], seeded, use_tqdm=False)]
            == [o.outputs[0].text for o in plain_llm.generate(inputs[3:], seeded, use_tqdm=False)])


def test_blocks_of_accepted_tokens_are_cached(spec_llm: LLM) -> None:
    """The blocks a sequence completes with accepted drafts join the prefix cache once the
    drafts are verified: a prompt that continues the output hits all but the last step's."""
    prompt = random_prompt(6, seed=8) * 3
    params = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    accepted_before = accepted_tokens(spec_llm)
    output = spec_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert accepted_tokens(spec_llm) > accepted_before
    follow_up = prompt + list(output.token_ids) + [3]
    hit = spec_llm.generate({"prompt_token_ids": follow_up}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    # The last step's tokens (its input and 3 drafts) may be in no block yet; the rest are cached.
    block_size = 8
    computed = len(prompt) + len(output.token_ids) - 1
    assert hit.num_cached_tokens >= (computed - 4) // block_size * block_size


def test_abort_beside_rows_with_drafts_frees_every_block(spec_llm: LLM, model_dir: str) -> None:
    engine = spec_llm.llm_engine
    prompts = [random_prompt(6, seed=s) * 3 for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    accepted_before = accepted_tokens(spec_llm)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(6):
        engine.step()
    engine.abort_request("abort-1")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {output.request_id: output for output in engine.step() if output.finished}
    assert sorted(outputs) == ["abort-0", "abort-2"] and accepted_tokens(spec_llm) > accepted_before
    for i in (0, 2):
        assert list(outputs[f"abort-{i}"].outputs[0].token_ids) == hf_greedy(model_dir, prompts[i], 40)[0]
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_verified_tokens_keep_the_target_distribution(spec_llm: LLM, model_dir: str) -> None:
    """Temperature 1: the third output token is sampled at a position that verifies a draft in
    every sample (the second may be decoded while the first is read back; then drafts are
    proposed, and max_tokens leaves room for one at the third); its frequencies must be the
    model's (chi-square). Accepting drafts more (or less) often than p(draft) would skew them
    toward (or away from) the drafts."""
    # Every token occurs in the prompt, so whatever the output tokens, a draft follows them.
    prompt = list(np.random.default_rng(1).permutation(VOCAB_SIZE))
    prompt = [int(token) for token in prompt + prompt[:5]]
    num_samples = 1200
    drafts_before = spec_llm.llm_engine.stats()["spec_decode_num_drafts"]
    outputs = spec_llm.generate([{"prompt_token_ids": prompt}] * num_samples,
                                SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert spec_llm.llm_engine.stats()["spec_decode_num_drafts"] - drafts_before >= num_samples
    counts = np.bincount([output.outputs[0].token_ids[2] for output in outputs], minlength=VOCAB_SIZE)
    model = load_hf_model(model_dir)
    pairs = [[first, second] for first in range(VOCAB_SIZE) for second in range(VOCAB_SIZE)]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
        second = torch.softmax(model(torch.tensor([prompt + [t] for t in range(VOCAB_SIZE)])).logits[:, -1], dim=-1)
        third = torch.softmax(model(torch.tensor([prompt + pair for pair in pairs])).logits[:, -1], dim=-1)
    # P(third) = sum over the first two tokens of P(first) P(second | first) P(third | both).
    expected = ((first[:, None] * second).reshape(-1) @ third).numpy() * num_samples
    # Cells expected under 5 times pooled into one, as the test asks.
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    chi_square = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert chi_square < 45.0, (chi_square, observed, expected)  # p < 1e-4 at 15 degrees of freedom


def test_seeded_samples_are_reproducible_and_batch_independent(spec_llm: LLM) -> None:
    prompt = random_prompt(8, seed=7) * 3
    seeded = SamplingParams(temperature=0.8, top_k=10, seed=11, max_tokens=40, ignore_eos=True)
    alone = spec_llm.generate({"prompt_token_ids": prompt}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": random_prompt(15, seed=s)} for s in range(3)]
    batch = spec_llm.generate([*others, {"prompt_token_ids": prompt}],
                              [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)] * 3 + [seeded],
                              use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.8, top_k=10, seed=12, max_tokens=40, ignore_eos=True)
    assert spec_llm.generate({"prompt_token_ids": prompt}, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_seeded_samples_are_the_ones_without_speculation(spec_llm: LLM, plain_llm: LLM) -> None:
    """A seeded sequence draws for each output position what it would without speculation,
    whether a decode step or a verify step samples it (and whatever the verify step rejects)."""
    prompts = [{"prompt_token_ids": random_prompt(6, seed=s) * 3} for s in range(4)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True, n=1 + s % 2) for s in range(3)]
    params.append(SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True))
    accepted_before = accepted_tokens(spec_llm)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    want = plain_llm.generate(prompts, params, use_tqdm=False)
    assert accepted_tokens(spec_llm) > accepted_before
    assert spec_llm.llm_engine.stats()["spec_decode_num_draft_tokens"] > accepted_tokens(spec_llm)  # some rejected
    for got_output, want_output in zip(got, want):
        assert [c.token_ids for c in got_output.outputs] == [c.token_ids for c in want_output.outputs]


class RunnerCalls:
    """Records, at each read-back (ModelRunner.collect), how many launched steps were not read
    back yet: 2 where the next step was launched first (overlapped steps), 1 where not."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        runner = llm.llm_engine.model_runner
        self.launched = 0
        self.in_flight_at_collect: list[int] = []
        launch_sampling, collect = runner.launch_sampling, runner.collect

        def record_launch(*args: Any) -> Any:
            self.launched += 1
            return launch_sampling(*args)

        def record_collect(*args: Any) -> Any:
            self.in_flight_at_collect.append(self.launched - len(self.in_flight_at_collect))
            return collect(*args)

        monkeypatch.setattr(runner, "launch_sampling", record_launch)
        monkeypatch.setattr(runner, "collect", record_collect)


def test_steps_overlap_where_nothing_matches(tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random text in a 768-token vocabulary: no bigram recurs, the proposer finds no drafts,
    and every step is launched before the one before it is read back, as without speculation."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=8,
              speculative_config={**SPEC, "prompt_lookup_min": 2})
    calls = RunnerCalls(llm, monkeypatch)
    prompts = [random_prompt(12, seed=s, vocab_size=768) for s in range(3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.stats()["spec_decode_num_drafts"] == 0
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 40)[0]
    # All but the last read-back (nothing more to launch) overlap the next step.
    in_flight = calls.in_flight_at_collect
    assert in_flight[:-1] == [2] * (len(in_flight) - 1) and len(in_flight) > 30, in_flight


@pytest.mark.parametrize("tight", [False, True])
def test_drafts_come_and_go(model_dir: str, monkeypatch: pytest.MonkeyPatch, tight: bool) -> None:
    """Trigram lookup over outputs that fall into loops and out of them: steps overlap until a
    proposal finds drafts, run one at a time while drafts are found, and overlap again once none
    are; greedy output stays the model's. Tight: with chunked prompts and preemptions too."""
    limits = dict(max_num_batched_tokens=16, num_gpu_blocks_override=40, max_num_seqs=6) if tight else {}
    llm = LLM(model_dir, dtype="float32", max_model_len=128, block_size=4 if tight else 8,
              speculative_config={**SPEC, "prompt_lookup_min": 3, "prompt_lookup_max": 4}, **limits)
    calls = RunnerCalls(llm, monkeypatch)
    prompts = [random_prompt(12, seed=s) for s in range(6)]
    for prompt in prompts[:2]:  # alone, then together with others at other points of their outputs
        output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=40,
                                                                           ignore_eos=True), use_tqdm=False)
        assert list(output[0].outputs[0].token_ids) == hf_greedy(model_dir, prompt, 40)[0]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0.0, max_tokens=40 + 3 * i, ignore_eos=True) for i in range(6)],
                           use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 40 + 3 * i)[0]
    stats = llm.llm_engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert (stats["num_preemptions"] > 0) == tight
    in_flight = calls.in_flight_at_collect
    switches = sum(a != b for a, b in itertools.pairwise(in_flight))
    assert in_flight.count(2) > 10 and in_flight.count(1) > 10 and switches > 6, in_flight


@pytest.mark.parametrize("case", ["max_tokens", "stop_token", "stop_string", "eos_after_min_tokens", "penalties",
                                  "logit_bias", "logprobs"])
def test_every_verified_token_is_treated_as_a_decoded_one(spec_llm: LLM, plain_llm: LLM, case: str) -> None:
    """Greedy, so the engine without speculation gives the answer: stops end the output at the
    same token (the tokens accepted past it dropped), penalties count the drafts before each
    position, logprobs are each kept token's own."""
    prompts = [random_prompt(6, seed=s) * 3 for s in range(4)]
    base = dict(temperature=0.0, max_tokens=45, ignore_eos=True)
    first = plain_llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**base), use_tqdm=False)
    tokens = list(first[0].outputs[0].token_ids)
    kwargs: dict = {
        "max_tokens": {"max_tokens": 29},
        "stop_token": {"stop_token_ids": [tokens[20]]},
        "stop_string": {"stop": [first[0].outputs[0].text[15]]},
        "eos_after_min_tokens": {"ignore_eos": False, "min_tokens": 12, "logit_bias": {0: 1.5}},
        # (In a 16-token vocabulary every token is soon present: the frequency penalty is what tells.)
        "penalties": {"frequency_penalty": 1.0, "presence_penalty": 0.2, "repetition_penalty": 1.1},
        "logit_bias": {"logit_bias": {tokens[3]: 1.0, tokens[5]: -2.0}},
        "logprobs": {"logprobs": 3},
    }[case]
    params = SamplingParams(**{**base, **kwargs})
    accepted_before = accepted_tokens(spec_llm)
    got = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = plain_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert accepted_tokens(spec_llm) > accepted_before
    for got_output, want_output in zip(got, want):
        got_completion, want_completion = got_output.outputs[0], want_output.outputs[0]
        assert got_completion.token_ids == want_completion.token_ids
        assert (got_completion.text, got_completion.finish_reason, got_completion.stop_reason) == (
            want_completion.text, want_completion.finish_reason, want_completion.stop_reason)
        if case == "logprobs":
            assert got_completion.logprobs is not None and want_completion.logprobs is not None
            for got_position, want_position in zip(got_completion.logprobs, want_completion.logprobs, strict=True):
                assert got_position.keys() == want_position.keys()
                for token, logprob in got_position.items():
                    assert logprob.logprob == pytest.approx(want_position[token].logprob, abs=1e-4)
                    assert logprob.rank == want_position[token].rank
            assert got_completion.cumulative_logprob == pytest.approx(want_completion.cumulative_logprob, abs=1e-3)


def test_metrics_and_stats_line(caplog: pytest.LogCaptureFixture) -> None:
    stats = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "num_free_blocks": 90,
             "num_blocks": 100, "num_running": 1, "num_waiting": 0, "spec_decode_num_drafts": 0,
             "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
             "spec_decode_num_accepted_tokens_pos0": 0, "spec_decode_num_accepted_tokens_pos1": 0}
    metrics = ServingMetrics("tiny", lambda: dict(stats))
    caplog.set_level("INFO", logger="minivllm.stats")
    metrics.log_stats()  # the baseline
    stats.update(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=20, spec_decode_num_accepted_tokens=9,
                 spec_decode_num_accepted_tokens_pos0=6, spec_decode_num_accepted_tokens_pos1=3)
    metrics.log_stats()
    spec_lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert len(spec_lines) == 1
    for fragment in ("Mean acceptance length: 1.90", "Accepted: 9 tokens", "Drafted: 20 tokens",
                     "Per-position acceptance rate: 0.600, 0.300", "Avg Draft acceptance rate: 45.0%"):
        assert fragment in spec_lines[0], (fragment, spec_lines[0])
    text = generate_latest(metrics.registry).decode()
    labels = 'engine="0",model_name="tiny"'
    for line in (f"vllm:spec_decode_num_drafts_total{{{labels}}} 10.0",
                 f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 20.0",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 9.0",
                 f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 3.0'):
        assert line in text.splitlines(), line


def gpu_llm(model_dir: str, **kwargs: Any) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128, block_size=8, gpu_memory_utilization=0.3,
               max_num_seqs=16, **kwargs)


@pytest.mark.gpu
def test_on_the_gpu_samples_are_the_ones_without_speculation(model_dir: str, tiny_model_factory,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels and CUDA graphs: greedy and seeded outputs with speculation are those
    without (verify steps run the mixed attention kernel where decodes replay graphs: float32
    rounds alike enough); and on random text in a 768-token vocabulary, steps overlap."""
    spec, plain = gpu_llm(model_dir, speculative_config=SPEC), gpu_llm(model_dir)
    prompts = [{"prompt_token_ids": random_prompt(6, seed=s) * 3} for s in range(4)]
    prompts += [{"prompt_token_ids": random_prompt(12, seed=s)} for s in range(4, 8)]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=48, ignore_eos=True)]
    for sampling in params:
        got = spec.generate(prompts, sampling, use_tqdm=False)
        want = plain.generate(prompts, sampling, use_tqdm=False)
        for got_output, want_output in zip(got, want):
            assert [c.token_ids for c in got_output.outputs] == [c.token_ids for c in want_output.outputs]
    assert accepted_tokens(spec) > 0
    spec.shutdown()
    plain.shutdown()
    no_match = gpu_llm(tiny_model_factory("Qwen3ForCausalLM"), speculative_config={**SPEC, "prompt_lookup_min": 2})
    calls = RunnerCalls(no_match, monkeypatch)
    no_match.generate([{"prompt_token_ids": random_prompt(12, seed=s, vocab_size=768)} for s in range(3)],
                      SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert no_match.llm_engine.stats()["spec_decode_num_drafts"] == 0
    assert calls.in_flight_at_collect[:-1] == [2] * (len(calls.in_flight_at_collect) - 1)
