"""Engine behaviour that engines of this kind have got wrong: edge lengths, identical
prompts in one step, aborts, stops, n > 1, logprobs, seeds, and bad input."""

import gc
import random
import subprocess
import sys
import weakref

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from tests.hf_oracle import hf_greedy

MAX_MODEL_LEN = 64
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)


def random_prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(count == 0 for count in kv.ref_counts)


def test_block_multiple_prompt_fully_cached(llm: LLM, model_dir: str) -> None:
    prompt = random_prompt(3 * BLOCK_SIZE, seed=1)
    want = hf_greedy(model_dir, prompt, 6)[0]
    hits_before = llm.llm_engine.stats()["prefix_cache_hits"]
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": prompt}, greedy(6), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want
    assert out.num_cached_tokens == 2 * BLOCK_SIZE
    # Second run: all but the last block hit; the last token is recomputed.
    assert llm.llm_engine.stats()["prefix_cache_hits"] - hits_before == 2 * BLOCK_SIZE


def test_reset_prefix_cache(llm: LLM, model_dir: str) -> None:
    """After LLM.reset_prefix_cache a prompt run before finds nothing cached, and its output
    is unchanged."""
    prompt = random_prompt(3 * BLOCK_SIZE, seed=4)
    want = hf_greedy(model_dir, prompt, 4)[0]
    llm.generate({"prompt_token_ids": prompt}, greedy(4), use_tqdm=False)
    assert llm.reset_prefix_cache()
    assert_all_blocks_free(llm.llm_engine)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and list(out.outputs[0].token_ids) == want


def test_identical_prompts_in_one_step(llm: LLM, model_dir: str) -> None:
    prompt = random_prompt(2 * BLOCK_SIZE + 3, seed=2)
    want = hf_greedy(model_dir, prompt, 5)[0]
    hits_before = llm.llm_engine.stats()["prefix_cache_hits"]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 4, greedy(5), use_tqdm=False)
    assert all(list(o.outputs[0].token_ids) == want for o in outputs)
    # The three later copies share the first copy's two full blocks, in the same step.
    assert llm.llm_engine.stats()["prefix_cache_hits"] - hits_before == 3 * 2 * BLOCK_SIZE


def test_prompt_of_max_model_len_minus_one(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": random_prompt(MAX_MODEL_LEN - 1)}, greedy(10), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"


def test_prompt_of_max_model_len_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": random_prompt(MAX_MODEL_LEN)}, greedy(1), use_tqdm=False)
    assert_all_blocks_free(llm.llm_engine)


def test_generation_stops_at_max_model_len(llm: LLM) -> None:
    prompt = random_prompt(50, seed=3)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(None), use_tqdm=False)[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == MAX_MODEL_LEN
    assert out.outputs[0].finish_reason == "length"


def test_abort_waiting_and_running_frees_every_block(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=2)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": random_prompt(20, seed=i)}, greedy(30))
    engine.step()
    assert {seq.request_id for seq in engine.scheduler.running} == {"r0", "r1"}
    engine.abort_request("r0")  # running
    engine.abort_request("r3")  # waiting
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["r1", "r2"]
    assert_all_blocks_free(engine)


def test_n_samples_share_prompt_blocks(llm: LLM) -> None:
    prompt = random_prompt(4 * BLOCK_SIZE, seed=4)
    hits_before = llm.llm_engine.stats()["prefix_cache_hits"]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Samples 1 and 2 reuse sample 0's three full prompt blocks (the last token is recomputed).
    assert llm.llm_engine.stats()["prefix_cache_hits"] - hits_before >= 2 * 3 * BLOCK_SIZE


def test_logprobs_match_hf(llm: LLM, model_dir: str) -> None:
    prompt = random_prompt(13, seed=6)
    want_tokens, want_logprobs = hf_greedy(model_dir, prompt, 6)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == want_tokens
    total = 0.0
    for token, position, ref in zip(out.token_ids, out.logprobs, want_logprobs):
        assert len(position) in (3, 4)  # top-3, plus the sampled token when it is not among them
        top3 = torch.topk(ref, 3).indices.tolist()
        assert set(top3) <= set(position)
        for token_id, logprob in position.items():
            assert abs(logprob.logprob - float(ref[token_id])) < 1e-4  # fp32 tolerance
        assert position[token].rank == 1  # greedy picks the most likely token
        total += position[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_seeded_sampling_is_batch_independent(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompt(10, seed=7)}
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (3, 17, 25)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(others[:2] + [prompt] + others[2:], [unseeded, unseeded, params, unseeded],
                           use_tqdm=False)[2].outputs[0].token_ids
    assert list(alone) == list(batched)


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = {"prompt_token_ids": random_prompt(9, seed=8)}
    tokens = llm.generate(prompt, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = llm.generate(prompt, greedy(10, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == list(tokens[:first + 1])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens forbids the stop token until enough tokens are out, so the text changes.
    delayed = llm.generate(prompt, greedy(10, stop_token_ids=[stop_id], min_tokens=first + 2),
                           use_tqdm=False)[0].outputs[0]
    assert len(delayed.token_ids) >= first + 2
    assert stop_id not in delayed.token_ids[:first + 2]


def test_stop_string_and_max_tokens(llm: LLM) -> None:
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_eos_stops_unless_ignored(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    prompt = {"prompt_token_ids": random_prompt(5, seed=9)}
    tokens = llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    # Pretend the model's 3rd greedy token is its EOS.
    eos = tokens[2]
    llm.llm_engine.eos_token_ids = {eos}
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert list(stopped.token_ids) == list(tokens[:tokens.index(eos) + 1])
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0]
    assert list(ignored.token_ids) == list(tokens) and ignored.finish_reason == "length"
    # min_tokens masks EOS in the sampler until enough tokens are out.
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8),
                        use_tqdm=False)[0].outputs[0]
    assert eos not in held.token_ids and len(held.token_ids) == 8


def test_logit_bias_forces_a_token_and_allowed_ids_restrict(llm: LLM) -> None:
    """A +100 bias wins every greedy step (across steady decode steps, which reuse the step's
    sampling metadata); allowed_token_ids keeps greedy and random rows to their set."""
    prompt = {"prompt_token_ids": random_prompt(7, seed=10)}
    forced = llm.generate(prompt, greedy(8, logit_bias={123: 100.0}), use_tqdm=False)[0].outputs[0]
    assert list(forced.token_ids) == [123] * 8
    allowed = [17, 250]
    for params in (greedy(8, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=3,
                                  allowed_token_ids=allowed)):
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == params.max_tokens and set(out.token_ids) <= set(allowed)


def test_bias_and_allowed_ids_do_not_leak_into_other_rows(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": random_prompt(n, seed=20 + n)} for n in (4, 9, 13, 6)]
    plain = [greedy(10), SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=10, ignore_eos=True)]
    alone = llm.generate(prompts[:2], plain, use_tqdm=False)
    special = [greedy(10, logit_bias={5: 100.0, 6: -100.0}), greedy(10, allowed_token_ids=[8, 9])]
    mixed = llm.generate([prompts[2], prompts[0], prompts[3], prompts[1]],
                         [special[0], plain[0], special[1], plain[1]], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in (mixed[1], mixed[3])] == \
        [list(o.outputs[0].token_ids) for o in alone]
    assert list(mixed[0].outputs[0].token_ids) == [5] * 10
    assert set(mixed[2].outputs[0].token_ids) <= {8, 9}


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n must"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_invalid_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_clean(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", ""], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, greedy(2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llm.llm_engine)
    # ... and it still serves.
    assert len(llm.generate("hello", greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_unknown_architecture_and_missing_directory(tmp_path, model_dir: str) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPTBigCodeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Supported architectures"):
        LLM(str(bad), dtype="float32")


def test_chat_applies_template(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi there"}]
    out = llm.chat(messages, greedy(3), use_tqdm=False)[0]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(want)
    assert len(out.outputs[0].token_ids) == 3


def test_next_step_is_launched_before_the_last_is_read_back(llm: LLM, model_dir: str) -> None:
    engine = llm.llm_engine
    prompt = random_prompt(11, seed=10)
    engine.add_request("overlap", {"prompt_token_ids": prompt}, greedy(6))
    engine.step()  # prefill launched
    engine.step()  # decode launched with the prefill's token still on the device
    seq = engine.requests["overlap"].seqs[0]
    assert engine.in_flight is not None and seq.num_pending_tokens == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert list(outputs[0].outputs[0].token_ids) == hf_greedy(model_dir, prompt, 6)[0]


def test_streamed_deltas_join_to_the_final_output(llm: LLM) -> None:
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": random_prompt(9, seed=11)}
    want = llm.generate(prompt, greedy(12, logprobs=1), use_tqdm=False)[0].outputs[0]
    engine.add_request("stream", prompt, greedy(12, logprobs=1), stream=True)
    token_ids, text, logprobs = [], "", []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids += output.outputs[0].token_ids
            text += output.outputs[0].text
            logprobs += output.outputs[0].logprobs
    assert token_ids == list(want.token_ids) and text == want.text
    assert [p.keys() for p in logprobs] == [p.keys() for p in want.logprobs]


def test_non_integer_token_ids_are_rejected(llm: LLM) -> None:
    for bad in ([1.0, 2.0], ["a"], [True, 3]):
        with pytest.raises(ValueError, match="integers"):
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": bad}], greedy(2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llm.llm_engine)


def test_a_failed_step_stops_the_engine(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE).llm_engine
    engine.add_request("r", {"prompt_token_ids": random_prompt(10)}, greedy(4))

    def broken_launch(batch: object) -> None:
        raise MemoryError("out of device memory")

    monkeypatch.setattr(engine.model_runner, "launch_forward", broken_launch)
    with pytest.raises(MemoryError):
        engine.step()
    # Its books no longer match the KV cache: it refuses to go on rather than risk wrong output.
    with pytest.raises(RuntimeError, match="failed in an earlier step"):
        engine.step()


def test_a_failed_start_stops_the_workers(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the model runner cannot be built, the tensor-parallel workers already started are
    stopped and the runner's own error is what the caller sees."""
    from minivllm.config import EngineConfig
    from minivllm.engine import llm_engine

    stopped = []

    class StartedWorkers:
        def __init__(self, config: EngineConfig) -> None:
            pass

        def shutdown(self) -> None:
            stopped.append(True)

    def broken_runner(config: EngineConfig, workers: object) -> None:
        raise MemoryError("no room for the weights")

    monkeypatch.setattr(llm_engine, "Workers", StartedWorkers)
    monkeypatch.setattr(llm_engine, "ModelRunner", broken_runner)
    with pytest.raises(MemoryError, match="no room for the weights"):
        LLMEngine(EngineConfig(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2))
    assert stopped == [True]


def test_start_up_warm_up_step_wraps_around_a_small_cache(model_dir: str) -> None:
    # The GPU start-up runs the largest step once after the KV cache exists (so that its
    # activations' memory stays cached). Its block ids wrap around the cache, and the
    # garbage it writes there must not reach any request.
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=9)
    runner, config = llm.llm_engine.model_runner, llm.llm_engine.config
    step = runner._largest_step(runner.num_blocks)
    assert sum(step.num_new_tokens) == min(config.max_num_batched_tokens, config.max_num_seqs * MAX_MODEL_LEN)
    assert {block for new in step.new_seqs for block in new.block_ids} == set(range(9))
    runner._run_step_and_sampler(step)  # as the GPU start-up does
    prompt = random_prompt(2 * BLOCK_SIZE + 5, seed=9)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(6), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 6)[0]


def test_startup_heap_frozen_and_a_deleted_engine_freed(model_dir: str) -> None:
    """The engine keeps the garbage collector off its start-up objects while it lives (no
    full collection pauses a step over them), and gives them back when it goes: a deleted
    LLM's engine is collected, not kept alive by the freeze."""
    gc.collect()
    gc.unfreeze()
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    assert gc.get_freeze_count() > 0
    engine = weakref.ref(llm.llm_engine)
    del llm
    gc.collect()
    assert engine() is None
    assert gc.get_freeze_count() == 0


def test_gc_threshold_raised_while_any_engine_lives(model_dir: str) -> None:
    """The first engine raises the young-generation threshold; it stays raised while any
    engine lives, and the process's own comes back when the last one shuts down (a second
    shutdown changes nothing). In a fresh interpreter: this module's fixture keeps an
    engine alive here."""
    script = f"""
import gc
from minivllm import LLM
from minivllm.engine.llm_engine import GC_YOUNG_THRESHOLD
gc.set_threshold(500, 9, 8)
first, second = (LLM({model_dir!r}, dtype="float32", max_model_len={MAX_MODEL_LEN}) for _ in range(2))
assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 9, 8), gc.get_threshold()
first.llm_engine.shutdown()
first.llm_engine.shutdown()
assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 9, 8), gc.get_threshold()
del second
assert gc.get_threshold() == (500, 9, 8), gc.get_threshold()
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize("name, total_gib, want", [
    ("NVIDIA H200", 140, 16384), ("NVIDIA H100 80GB HBM3", 80, 16384),
    ("NVIDIA A100-SXM4-80GB", 80, 8192), ("NVIDIA L4", 24, 8192)])
def test_default_token_budget_follows_vllm(monkeypatch: pytest.MonkeyPatch, name: str, total_gib: int,
                                           want: int) -> None:
    """Without max_num_batched_tokens a step holds vLLM's LLM-class default: 16,384 tokens on a
    GPU of 70 GiB or more (not an A100), 8,192 elsewhere, on CPU too."""
    from types import SimpleNamespace

    from minivllm.config import default_max_num_batched_tokens
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=total_gib * 2**30))
    assert default_max_num_batched_tokens(torch.device("cuda")) == want
    assert default_max_num_batched_tokens(torch.device("cpu")) == 8192
