"""What users do with the engine, end to end on CPU (fp32 tiny models), each checked
against something computed independently of it:

- penalties (presence, frequency, repetition) under the overlapped step, against Hugging
  Face logits with the penalty formula applied here, greedy, step by step;
- n > 1 streamed through LLMEngine.step, with stop strings and logprobs: the deltas join
  to the non-streamed result, which in turn is the unstopped text cut at the stop string;
- seeded sampling gives the same tokens whether or not the KV cache forces preemption;
- abort_request: what the caller sees, and every block back in the pool;
- skip_tokenizer_init=True: token-id prompts work, text prompts are refused.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from tests.conftest import TinyModelFactory
from tests.hf_oracle import hf_greedy, load_hf_model

MAX_MODEL_LEN = 64
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: TinyModelFactory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    """A roomy engine: no preemption, default budget."""
    return make_llm(model_dir)


def make_llm(model_dir: str, **kwargs: object) -> LLM:
    return LLM(model_dir, **{"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
                             **kwargs})


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert not any(engine.kv_cache_manager.ref_counts)


# --- penalties ----------------------------------------------------------------------------------

PENALTY_CASES: list[dict[str, float]] = [
    {"presence_penalty": -2.0},  # output tokens come back
    {"frequency_penalty": -1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 1.5},  # sign flips with the count: count matters
    {"repetition_penalty": 0.5},  # prompt and output tokens pulled in
    {"repetition_penalty": 2.0},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.0},
    {"presence_penalty": 1.0, "frequency_penalty": -0.5, "repetition_penalty": 1.5},
]
# Prompts on which plain greedy repeats tokens, so that positive penalties have something to act on.
PENALTY_PROMPTS = [random_prompt(n, seed=1000 * n + s) for n, s in ((5, 3), (9, 1), (10, 1), (14, 0), (21, 5))]
PENALTY_MAX_TOKENS = 16


def penalised_greedy(model_dir: str, prompt: list[int], max_tokens: int, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, repetition_penalty: float = 1.0) -> list[int]:
    return _penalised_greedy(model_dir, tuple(prompt), max_tokens, presence_penalty, frequency_penalty,
                             repetition_penalty)


@functools.cache
@torch.no_grad()
def _penalised_greedy(model_dir: str, prompt: tuple[int, ...], max_tokens: int, presence: float,
                      frequency: float, repetition: float) -> list[int]:
    """Greedy decoding with vLLM's penalties, from Hugging Face logits, one full forward per
    token: repetition divides positive (multiplies negative) logits of every token seen in
    the prompt or output; frequency * count and presence * (count > 0) over the output
    tokens are subtracted."""
    model = load_hf_model(model_dir)
    ids, output = list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.zeros_like(logits)
        for token in output:
            counts[token] += 1
        if repetition != 1.0:
            seen = counts > 0
            seen[list(prompt)] = True
            penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits = torch.where(seen, penalised, logits)
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        output.append(token)
        ids.append(token)
    return output


PenaltyRequest = tuple[list[int], SamplingParams, list[int]]  # prompt, params, reference tokens


def penalty_requests(model_dir: str) -> list[PenaltyRequest]:
    """Every penalty case on every prompt, with lengths that make them finish at different
    steps, then plain greedy requests on the same prompts; each with its reference tokens."""
    requests: list[PenaltyRequest] = []
    for i, case in enumerate(PENALTY_CASES):
        for j, prompt in enumerate(PENALTY_PROMPTS):
            max_tokens = PENALTY_MAX_TOKENS - (i + j) % 3
            requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **case),
                             penalised_greedy(model_dir, prompt, max_tokens, **case)))
    for prompt in PENALTY_PROMPTS:  # no penalty: alone, these overlap steps
        max_tokens = PENALTY_MAX_TOKENS + 6
        requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         hf_greedy(model_dir, prompt, max_tokens)[0]))
    return requests


def run_penalty_batch(llm: LLM, model_dir: str) -> None:
    """All of penalty_requests in one generate call: each must give its reference tokens."""
    requests = penalty_requests(model_dir)
    outputs = llm.generate(token_prompts([prompt for prompt, _, _ in requests]),
                           [params for _, params, _ in requests], use_tqdm=False)
    mismatches = [(params, prompt, list(output.outputs[0].token_ids), want)
                  for (prompt, params, want), output in zip(requests, outputs)
                  if list(output.outputs[0].token_ids) != want]
    assert not mismatches, mismatches[:3]


def test_penalty_cases_change_greedy_output(model_dir: str) -> None:
    """Guard for the penalty tests: every case changes the reference greedy tokens of at
    least one of its requests, so an engine that ignored a penalty could not pass them."""
    requests = penalty_requests(model_dir)
    for i, case in enumerate(PENALTY_CASES):
        of_case = requests[i * len(PENALTY_PROMPTS):(i + 1) * len(PENALTY_PROMPTS)]
        assert any(want != hf_greedy(model_dir, prompt, params.max_tokens)[0] for prompt, params, want in of_case), case


def test_penalties_match_reference(llm: LLM, model_dir: str) -> None:
    """Penalised greedy requests batched with plain ones (which overlap steps while no
    penalised request runs) give the reference tokens."""
    run_penalty_batch(llm, model_dir)


def test_penalties_match_reference_under_preemption_and_chunking(model_dir: str) -> None:
    """The same batch through a small KV cache (preemption), a small token budget (chunked
    prompts) and max_num_seqs (late admission): penalties still see exactly the tokens
    generated so far, none missing, none twice."""
    llm = make_llm(model_dir, num_gpu_blocks_override=12, max_num_batched_tokens=24,
                   max_num_seqs=6, enable_prefix_caching=False)
    run_penalty_batch(llm, model_dir)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm.llm_engine)


# --- n > 1, streaming, stop strings, logprobs --------------------------------------------------


def join_stream(engine: LLMEngine, request_id: str, n: int) -> tuple[list[CompletionOutput], list[RequestOutput]]:
    """Step until the request is done; per sample, its deltas joined into one output."""
    joined = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=[])
              for i in range(n)]
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request_id
            outputs.append(output)
            for delta in output.outputs:
                total = joined[delta.index]
                total.text += delta.text
                total.token_ids += list(delta.token_ids)
                total.logprobs += delta.logprobs or []
                total.cumulative_logprob = delta.cumulative_logprob
                total.finish_reason, total.stop_reason = delta.finish_reason, delta.stop_reason
    return joined, outputs


def assert_same_logprobs(got: list[dict[int, Logprob]], want: list[dict[int, Logprob]]) -> None:
    """Same positions, candidate tokens and ranks; logprobs equal to fp32 rounding."""
    assert [{t: lp.rank for t, lp in p.items()} for p in got] == [{t: lp.rank for t, lp in p.items()} for p in want]
    for got_position, want_position in zip(got, want):
        for token, logprob in want_position.items():
            assert got_position[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)


def test_n_samples_streamed_with_stop_strings_and_logprobs(llm: LLM) -> None:
    """n = 3 seeded samples with a stop string and logprobs: the streamed deltas of each
    sample join to its non-streamed output (text, tokens, logprobs, finish reason), and
    that output is the unstopped sample cut at the stop string."""
    engine = llm.llm_engine
    prompt = "The quick brown fox"
    base = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 16, "ignore_eos": True, "logprobs": 2}
    full = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in full}) == 3  # three different samples
    stop = full[1].text[4:6]  # a stop string sample 1 surely produces
    params = SamplingParams(**base, stop=[stop])

    engine.add_request("plain", prompt, params)
    plain_outputs = join_stream(engine, "plain", 3)[1]
    assert len(plain_outputs) == 1 and plain_outputs[0].finished  # offline: one output, at the end
    final = plain_outputs[0]
    engine.add_request("stream", prompt, params, stream=True)
    joined, stream_outputs = join_stream(engine, "stream", 3)

    assert [o.finished for o in stream_outputs] == [False] * (len(stream_outputs) - 1) + [True]
    assert len(stream_outputs) > 4  # one output per step, not one at the end
    num_stopped = 0
    for whole, got, want in zip(full, joined, final.outputs):
        # Non-streamed == the unstopped sample cut where the stop string starts.
        if stop in whole.text:
            num_stopped += 1
            assert (want.finish_reason, want.stop_reason) == ("stop", stop)
            assert want.text == whole.text[:whole.text.index(stop)]
            assert list(want.token_ids) == list(whole.token_ids[:len(want.token_ids)])
            assert len(want.token_ids) < len(whole.token_ids)
        else:
            assert (want.finish_reason, want.text, list(want.token_ids)) == ("length", whole.text,
                                                                             list(whole.token_ids))
        # Streamed deltas == non-streamed.
        assert got.text == want.text
        assert got.token_ids == list(want.token_ids)
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        assert_same_logprobs(got.logprobs, want.logprobs)
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
        # Logprobs: one position per token, holding the sampled token, and summing to the cumulative one.
        assert len(want.logprobs) == len(want.token_ids)
        assert all(token in position and len(position) in (2, 3)
                   for token, position in zip(want.token_ids, want.logprobs))
        assert want.cumulative_logprob == pytest.approx(
            sum(position[token].logprob for token, position in zip(want.token_ids, want.logprobs)), abs=1e-4)
    assert num_stopped >= 1
    assert_all_blocks_free(engine)


# --- seeded sampling and preemption ------------------------------------------------------------


def seeded_batch() -> tuple[list[dict[str, list[int]]], list[SamplingParams]]:
    """Seeded random requests of various lengths and filters, two with n = 2, one penalised."""
    prompts = token_prompts([random_prompt(n, seed=100 + n) for n in (3, 9, 17, 25, 33, 6)])
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(temperature=1.2, top_k=20, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=4, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, n=2, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, seed=6, max_tokens=16, ignore_eos=True),
    ]
    return prompts, params


def test_seeded_sampling_reproduces_across_preemption(llm: LLM, model_dir: str) -> None:
    """Seeded requests give the same tokens when a KV cache too small for the batch
    preempts and recomputes them as when nothing is preempted."""
    prompts, params = seeded_batch()
    roomy = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.stats()["num_preemptions"] == 0
    tight_llm = make_llm(model_dir, num_gpu_blocks_override=10, enable_prefix_caching=False)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.llm_engine.stats()["num_preemptions"] > 0
    want = [[list(c.token_ids) for c in o.outputs] for o in roomy]
    got = [[list(c.token_ids) for c in o.outputs] for o in tight]
    assert got == want
    assert all(len(c.token_ids) == p.max_tokens for o, p in zip(roomy, params) for c in o.outputs)
    assert want[1][0] != want[1][1]  # n = 2 samples differ: each has its own stream
    assert_all_blocks_free(tight_llm.llm_engine)


# --- abort --------------------------------------------------------------------------------------


def test_abort_running_request_while_its_step_is_in_flight(llm: LLM, model_dir: str) -> None:
    """Aborting a streamed n = 2 request mid-generation (a token of it still on the device):
    abort_request returns nothing, no output for it ever comes back (its last delta said
    finished=False, finish_reason None), its blocks are free at once, and the request
    beside it finishes with the right tokens."""
    engine = llm.llm_engine
    keep_prompt = random_prompt(13, seed=21)
    engine.add_request("victim", {"prompt_token_ids": random_prompt(21, seed=20)},
                       SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True), stream=True)
    engine.add_request("keep", {"prompt_token_ids": keep_prompt},
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen: list[RequestOutput] = []
    for _ in range(4):
        seen += engine.step()
    victim_seqs = engine.requests["victim"].seqs
    assert engine.in_flight is not None and all(seq.num_pending_tokens == 1 for seq in victim_seqs)
    last_delta = seen[-1]
    assert last_delta.request_id == "victim" and not last_delta.finished
    assert all(c.finish_reason is None for c in last_delta.outputs)
    num_tokens = [len(seq.output_token_ids) for seq in victim_seqs]

    assert engine.abort_request("victim") is None
    assert "victim" not in engine.requests
    assert [seq.finish_reason for seq in victim_seqs] == ["abort", "abort"]
    assert [seq.num_pending_tokens for seq in victim_seqs] == [0, 0]
    held_by_keep = len(engine.requests["keep"].seqs[0].block_table)
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"] - held_by_keep

    after: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        after += engine.step()
    assert [o.request_id for o in after] == ["keep"]
    assert list(after[0].outputs[0].token_ids) == hf_greedy(model_dir, keep_prompt, 12)[0]
    assert [len(seq.output_token_ids) for seq in victim_seqs] == num_tokens  # the in-flight token was dropped
    assert_all_blocks_free(engine)
    engine.abort_request("victim")  # again, and unknown ids: no-ops
    engine.abort_request("never-added")


def test_abort_waiting_request_and_reuse_its_id(model_dir: str) -> None:
    """A request aborted before it ever ran leaves nothing behind, and its id can be used
    again for a request that then runs normally."""
    llm = make_llm(model_dir, max_num_seqs=1)
    engine = llm.llm_engine
    first, second = random_prompt(10, seed=30), random_prompt(12, seed=31)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": first}, greedy)
    engine.add_request("b", {"prompt_token_ids": second}, greedy)
    engine.step()
    assert engine.stats()["num_waiting"] == 1  # b waits: max_num_seqs=1
    engine.abort_request("b")
    assert engine.stats()["num_waiting"] == 0
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["a"]
    engine.add_request("b", {"prompt_token_ids": second}, greedy)
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["a", "b"]
    assert list(finished[1].outputs[0].token_ids) == hf_greedy(model_dir, second, 5)[0]
    assert_all_blocks_free(engine)


# --- skip_tokenizer_init ------------------------------------------------------------------------


def test_skip_tokenizer_init_generates_from_token_ids(llm: LLM, model_dir: str) -> None:
    """Without a tokenizer, token-id prompts (dict or bare list) generate the same tokens as
    Hugging Face, with empty text and no decoded logprob tokens; EOS still comes from the
    model's generation config."""
    bare = make_llm(model_dir, skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    prompts = [random_prompt(7, seed=40), random_prompt(19, seed=41)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = bare.generate([{"prompt_token_ids": prompts[0]}, prompts[1]], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert output.prompt is None and output.prompt_token_ids == prompt
        assert list(completion.token_ids) == hf_greedy(model_dir, prompt, 6)[0]
        assert completion.text == ""
        assert all(lp.decoded_token is None for position in completion.logprobs for lp in position.values())
    assert bare.llm_engine.eos_token_ids and bare.llm_engine.eos_token_ids == llm.llm_engine.eos_token_ids


@pytest.mark.parametrize("prompt", ["hello there", {"prompt": "hello there"}], ids=["text", "prompt-dict"])
def test_skip_tokenizer_init_refuses_text_prompts(model_dir: str, prompt: str | dict[str, str]) -> None:
    """A text prompt without a tokenizer is a clear ValueError naming the fix, and the engine
    is left clean and still serves token-id prompts."""
    llm = make_llm(model_dir, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=r"skip_tokenizer_init.*prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llm.llm_engine)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(model_dir, [5, 6, 7], 3)[0]


def test_skip_tokenizer_init_refuses_stop_strings(model_dir: str) -> None:
    """Stop strings cannot be found without a tokenizer: asking for one must be a ValueError,
    not a request that quietly generates past it."""
    llm = make_llm(model_dir, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, stop=["e"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
