"""Structured outputs (xgrammar) offline, on CPU with a tiny random model: every output follows
its JSON schema, regex, choice list or grammar, checked here independently of xgrammar (json,
re, explicit schema checks), with everything else the engine does alongside: n > 1, seeds,
preemption and recompute, prefix-cache hits, stop strings, min_tokens, logprobs, and a batch
whose other requests must not notice. Plus the pieces alone: StructuredOutputsParams, the
grammar checks, the bitmask applied to logits, the reasoning hook, compiles off the step loop."""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Any

import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.engine import structured_outputs
from minivllm.engine.grammar_spec import GrammarSpec, check_structured_outputs
from minivllm.engine.structured_outputs import StructuredOutputManager
from minivllm.layers.sampler import apply_token_bitmask, block_stop_tokens
from minivllm.outputs import RequestOutput
from tests.conftest import TinyModelFactory
from tests.tool_models import build_tool_model

MAX_MODEL_LEN = 128
BLOCK_SIZE = 8
PROMPTS = ["Hello", "The quick brown fox", "Count from one", "def fibonacci(n"]

# Every JSON feature the tests need bounded, so that an answer always ends well inside max_tokens.
# (A pattern rather than maxLength bounds the string: xgrammar 0.2.9's maxLength strings allow raw
# control characters, which JSON does not.)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "place": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"]},
    },
    "required": ["name", "age", "color", "tags", "place"],
}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "maybe so"]
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" num | num "*" num\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_AS_REGEX = r"\((\d|[1-9]\d)([+*](\d|[1-9]\d))?\)"


def follows_schema(text: str) -> bool:
    """SCHEMA's constraints, checked by hand."""
    value = json.loads(text)
    place = value.get("place")
    return (set(value) == set(SCHEMA["properties"]) and isinstance(value["name"], str)
            and re.fullmatch("[A-Za-z ]{1,6}", value["name"]) is not None
            and type(value["age"]) is int and 0 <= value["age"] <= 120 and value["color"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(type(tag) is bool for tag in value["tags"])
            and isinstance(place, dict) and set(place) == {"x"} and type(place["x"]) is int and -5 <= place["x"] <= 5)


# (constraint, check of a finished output's text)
CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), follows_schema),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "grammar": (StructuredOutputsParams(grammar=EBNF), lambda text: re.fullmatch(EBNF_AS_REGEX, text) is not None),
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: TinyModelFactory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


def make_llm(model_dir: str, **kwargs: Any) -> LLM:
    return LLM(model_dir, **{"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, **kwargs})


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return make_llm(model_dir)


def texts(outputs: list[RequestOutput]) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


# --- the parameters and the grammar checks -----------------------------------------------------


def test_params_take_exactly_one_constraint() -> None:
    assert StructuredOutputsParams(regex="a+").constraint == "regex"
    for bad, fragment in [({}, "got none"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
                          ({"json": 5}, "json must be"), ({"choice": []}, "non-empty list"),
                          ({"choice": ["a", 1]}, "list of strings"), ({"json_object": False}, "must be True"),
                          ({"regex": ""}, "non-empty"), ({"grammar": "x", "whitespace_pattern": " "}, "whitespace"),
                          ({"regex": "a", "disable_any_whitespace": 1}, "boolean")]:
        with pytest.raises(ValueError, match=fragment):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize(("params", "fragment"), [
    (StructuredOutputsParams(json={"type": "foo"}), 'Invalid JSON schema: Unsupported type "foo"'),
    (StructuredOutputsParams(json="{not json"), "The JSON schema is not valid JSON"),
    (StructuredOutputsParams(json={"x": {1, 2}}), "The JSON schema is not JSON"),
    (StructuredOutputsParams(regex="(ab"), "Invalid regex: Regex parsing error at position 4"),
    (StructuredOutputsParams(grammar='root ::= "a" | '), "Invalid grammar: EBNF parser error at line 1"),
    (StructuredOutputsParams(grammar="start: ("), "Invalid grammar: Lark error"),
    (StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
     "Invalid structural tag"),
])
def test_invalid_specs_quote_xgrammar(params: StructuredOutputsParams, fragment: str) -> None:
    with pytest.raises(ValueError) as error:
        check_structured_outputs(params)
    assert fragment in str(error.value) and "/project/cpp" not in str(error.value), str(error.value)


def test_specs() -> None:
    """Choices become an EBNF grammar with JSON's escapes (which are EBNF's); a JSON schema keeps
    its property order; Lark grammars are taken too."""
    choice = GrammarSpec.of(StructuredOutputsParams(choice=['a"b', "new\nline", "é"]))
    assert choice == GrammarSpec("choice", 'root ::= "a\\"b" | "new\\nline" | "é"')
    check_structured_outputs(StructuredOutputsParams(choice=['a"b', "new\nline", "é", ""]))
    schema = GrammarSpec.of(StructuredOutputsParams(json={"b": 1, "a": 2}, disable_any_whitespace=True))
    assert schema == GrammarSpec("json", '{"b": 1, "a": 2}', any_whitespace=False)
    check_structured_outputs(StructuredOutputsParams(grammar='start: "yes" | "no"'))
    check_structured_outputs(StructuredOutputsParams(
        structural_tag='{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'))


def test_bitmask_on_logits_matches_xgrammar() -> None:
    """apply_token_bitmask masks what xgrammar's own kernel masks: all rows, or some rows (the
    others untouched), with a vocabulary that does not fill the last word or one wider than the
    bitmask."""
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(0)
    vocab_size, num_rows = 100, 5
    bitmask = torch.randint(-(2**31), 2**31, (num_rows, 4), dtype=torch.int32, generator=generator)
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab_size)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, None)
    assert torch.equal(got, want)
    rows = [3, 0]
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab_size, indices=rows)
    got = logits.clone()
    apply_token_bitmask(got, bitmask[rows], torch.tensor(rows).numpy())
    assert torch.equal(got, want)
    # Logits wider than the bitmask (a padded vocabulary): the tokens past it are never allowed.
    wide = torch.randn(num_rows, 160, generator=generator)
    got = wide.clone()
    apply_token_bitmask(got, bitmask, None)
    want = wide[:, :128].clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(got[:, :128], want) and torch.isneginf(got[:, 128:]).all()
    # Some rows of those: the others untouched.
    got = wide.clone()
    apply_token_bitmask(got, bitmask[rows], torch.tensor(rows).numpy())
    masked = wide[rows, :128].clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask[rows])
    want = wide.clone()
    want[rows, :128], want[rows, 128:] = masked, -math.inf
    assert torch.equal(got, want)


def test_min_tokens_does_not_block_a_row_with_nothing_else_left() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [-math.inf, -math.inf, 0.5]])
    block_stop_tokens(logits, torch.tensor([0, 1]), torch.tensor([2, 2]))
    assert logits.tolist() == [[1.0, 2.0, -math.inf], [-math.inf, -math.inf, 0.5]]


# --- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_follows_its_constraint(llm: LLM, temperature: float) -> None:
    """Each kind of constraint, n = 2 (4 prompts: 8 guided rows a step), seeded when random,
    all in one batch; every sample ends by itself ("stop") and follows its constraint."""
    params = [SamplingParams(max_tokens=100, temperature=temperature, seed=7, n=2, structured_outputs=so)
              for so, _ in CASES.values()]
    outputs = llm.generate([p for p in PROMPTS for _ in CASES], [p for _ in PROMPTS for p in params],
                           use_tqdm=False)
    for i, output in enumerate(outputs):
        _, follows = list(CASES.values())[i % len(CASES)]
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            assert follows(completion.text), completion.text
    if temperature > 0:  # the two samples of a request differ somewhere
        assert any(len(set(texts([o]))) > 1 for o in outputs)


def test_an_fp8_kv_cache(model_dir: str) -> None:
    """The FP8 KV cache changes the logits, not the masking: every output still follows its
    constraint."""
    llm = make_llm(model_dir, kv_cache_dtype="fp8")
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=3, structured_outputs=so)
              for so, _ in CASES.values()]
    outputs = llm.generate([PROMPTS[1]] * len(params), params, use_tqdm=False)
    for output, (_, follows) in zip(outputs, CASES.values()):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and follows(completion.text), completion


def test_json_object(llm: LLM) -> None:
    """json_object: what ends by itself is a JSON object (a random model may also write one
    past max_tokens)."""
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0, structured_outputs=so),
                           use_tqdm=False)
    finished = [c for o in outputs for c in o.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 2
    assert all(isinstance(json.loads(c.text), dict) for c in finished)
    assert all(len(c.token_ids) == 60 for o in outputs for c in o.outputs if c.finish_reason != "stop")


def test_masks_filled_on_threads(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's 16 guided rows (n = 8 samples of two requests) filled on two of xgrammar's
    threads, each sample its own: the same tokens as a request alone, filled on one (seeded)."""
    monkeypatch.setattr(structured_outputs, "ROWS_PER_FILL_THREAD", 8)
    monkeypatch.setattr(llm.llm_engine.structured_outputs, "_max_fill_threads", 2)
    n = 8
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=n, structured_outputs=CASES["regex"][0])
    together = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    alone = [llm.generate(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=1,
                                                 structured_outputs=CASES["regex"][0]), use_tqdm=False)[0]
             for prompt in PROMPTS[:2]]
    assert all(re.fullmatch(REGEX, text) for text in texts(together))
    assert [tokens([o])[0] for o in together] == tokens(alone)


def test_preemption_recomputes_without_refeeding_the_grammar(model_dir: str, llm: LLM) -> None:
    """A KV cache too small for the batch preempts guided sequences and recomputes them: the
    same seeded tokens as without preemption, still valid (a token fed to a grammar twice, or
    lost, would change or break them)."""
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=11 + i, n=2, structured_outputs=so)
              for i, so in enumerate([CASES["json"][0], CASES["json"][0], CASES["regex"][0], CASES["grammar"][0]])]
    roomy = llm.generate(PROMPTS, params, use_tqdm=False)
    # Room for one sequence of max_model_len tokens: the four JSON answers (~80 tokens each) do not fit.
    tight_llm = make_llm(model_dir, num_gpu_blocks_override=MAX_MODEL_LEN // BLOCK_SIZE, enable_prefix_caching=False)
    tight = tight_llm.generate(PROMPTS, params, use_tqdm=False)
    assert tight_llm.llm_engine.stats()["num_preemptions"] > 0
    assert tokens(tight) == tokens(roomy)
    assert all(follows_schema(text) for text in texts(tight[:2]))


def test_prefix_cache_hits(model_dir: str) -> None:
    """A guided request whose prompt is in the prefix cache: the same greedy answer."""
    prompt = " ".join(PROMPTS * 4)
    fresh = make_llm(model_dir, max_model_len=2 * MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=100, temperature=0, structured_outputs=CASES["json"][0])
    first = fresh.generate(prompt, params, use_tqdm=False)
    second = fresh.generate(prompt, params, use_tqdm=False)
    assert second[0].num_cached_tokens > 0 and fresh.llm_engine.stats()["prefix_cache_hits"] > 0
    assert texts(second) == texts(first) and first[0].outputs[0].finish_reason == "stop"
    assert follows_schema(texts(first)[0])


def test_unguided_requests_do_not_notice(llm: LLM) -> None:
    """Greedy and seeded requests without a constraint give the same tokens beside guided ones
    (their rows are not masked; the guided steps' split launch changes nothing for them)."""
    plain = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    guided = [SamplingParams(max_tokens=100, temperature=1.0, seed=1, structured_outputs=so)
              for so, _ in CASES.values()]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS, plain + guided, use_tqdm=False)
    assert tokens(mixed[:2]) == tokens(alone)
    assert all(follows(c.text) for (_, follows), o in zip(CASES.values(), mixed[2:]) for c in o.outputs)


def test_a_guided_step_queues_the_next_forward_pass_behind_its_sampling(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a steady guided batch, each step's sampling is queued right before the next step's
    forward pass (prepared beforehand), and only then is the sampled step read back: the device
    runs the next forward pass while the host reads back, advances the grammars and fills the
    next masks."""
    runner = llm.llm_engine.model_runner
    calls: list[str] = []
    for name in ("prepare_forward", "launch_forward", "launch_sampling", "collect"):
        method = getattr(runner, name)

        def record(*args: Any, _name: str = name, _method: Any = method) -> Any:
            calls.append(_name)
            return _method(*args)

        monkeypatch.setattr(runner, name, record)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{20}"))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(re.fullmatch("[a-z]{20}", text) for text in texts(outputs))
    steady = ["prepare_forward", "launch_sampling", "launch_forward", "collect"]
    cycles = sum(calls[i:i + 4] == steady for i in range(len(calls)))
    # Every read-back is such a cycle's but the first (a step left in flight by an earlier
    # generate) and the last (nothing more to schedule).
    assert cycles >= calls.count("collect") - 2 >= 5, calls


def test_stop_strings_cut_a_guided_output(llm: LLM) -> None:
    whole = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0, structured_outputs=CASES["regex"][0]),
                         use_tqdm=False)
    cut = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0, stop=["-"],
                                               structured_outputs=CASES["regex"][0]), use_tqdm=False)
    assert [c.text for c in (o.outputs[0] for o in cut)] == [text.split("-")[0] for text in texts(whole)]
    assert all(o.outputs[0].stop_reason == "-" for o in cut)


def test_logprobs_see_the_grammar(llm: LLM, tokenizer: Any) -> None:
    """Logprobs come from the masked logits: at each position the tokens with a finite logprob
    are those the choice list allows there, and their probabilities sum to 1 (the top 20 hold
    them all); after a complete answer, only the stop tokens (EOS and its kin) are left."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=20, structured_outputs=CASES["choice"][0])
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.text in CHOICES and completion.logprobs is not None
        written = ""
        for token, position in zip(completion.token_ids, completion.logprobs):
            allowed = {t: p.logprob for t, p in position.items() if p.logprob > -math.inf}
            assert math.isclose(sum(math.exp(v) for v in allowed.values()), 1.0, rel_tol=1e-4)
            if written in CHOICES:  # complete
                assert set(allowed) == llm.llm_engine.eos_token_ids and token in allowed
                break
            assert all(any(c.startswith(written + tokenizer.decode([t])) for c in CHOICES) for t in allowed)
            written += tokenizer.decode([token])


def test_min_tokens_yields_to_a_complete_grammar(llm: LLM) -> None:
    """min_tokens holds the stop token back only while the grammar allows something else: a
    choice then ends "stop", short of min_tokens, rather than sample a token nothing allows."""
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, min_tokens=10, temperature=0,
                                                   structured_outputs=CASES["choice"][0]), use_tqdm=False)
    for completion in (o.outputs[0] for o in outputs):
        assert completion.text in CHOICES and completion.finish_reason == "stop"
        assert len(completion.token_ids) < 10


def test_ignore_eos_ends_with_the_grammar(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                   structured_outputs=CASES["regex"][0]), use_tqdm=False)
    assert all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for o in outputs for c in o.outputs)


def test_invalid_specs_are_refused_before_anything_is_queued(llm: LLM) -> None:
    for so in (StructuredOutputsParams(json={"type": "foo"}), StructuredOutputsParams(regex="(ab"),
               StructuredOutputsParams(grammar="root ::= ")):
        with pytest.raises(ValueError, match="Invalid"):
            llm.generate(PROMPTS, SamplingParams(structured_outputs=so), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert texts(llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0,
                                                         structured_outputs=CASES["choice"][0]),
                              use_tqdm=False))[0] in CHOICES


class _HeldCompiles:
    """Grammar compiles that wait until released (or fail, when told to)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: Exception | None = None) -> None:
        self.release = threading.Event()
        compile_now = StructuredOutputManager._compile_now

        def held(manager: StructuredOutputManager, spec: GrammarSpec) -> Any:
            assert self.release.wait(30)
            if error is not None:
                raise error
            return compile_now(manager, spec)

        monkeypatch.setattr(StructuredOutputManager, "_compile_now", held)


def test_a_slow_compile_does_not_stall_other_requests(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a guided request's grammar compiles, the request waits outside the scheduler and a
    plain request runs to its end; then the guided one runs."""
    held = _HeldCompiles(monkeypatch)
    engine = make_llm(model_dir).llm_engine
    engine.add_request("guided", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0,
                                                            structured_outputs=StructuredOutputsParams(regex="ab{1,3}c")))
    engine.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True))
    finished: dict[str, RequestOutput] = {}
    while "plain" not in finished:
        finished.update((o.request_id, o) for o in engine.step())
        assert len(engine.scheduler.running) + len(engine.scheduler.waiting) <= 1  # the guided one waits
        assert engine.stats()["num_waiting"] >= 1  # and counts as waiting
    assert "guided" not in finished and len(finished["plain"].outputs[0].token_ids) == 20
    held.release.set()
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    assert re.fullmatch("ab{1,3}c", finished["guided"].outputs[0].text)


def test_a_failed_compile_fails_its_request_alone(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    held = _HeldCompiles(monkeypatch, RuntimeError("out of memory, say"))
    held.release.set()
    llm = make_llm(model_dir)
    outputs = llm.generate(PROMPTS[:2], [SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
                                         SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].outputs[0].token_ids == [] and len(outputs[1].outputs[0].token_ids) == 5


def test_abort_while_compiling(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    held = _HeldCompiles(monkeypatch)
    engine = make_llm(model_dir).llm_engine
    engine.add_request("guided", PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    assert engine.step() == []
    engine.abort_request("guided")
    held.release.set()
    assert not engine.has_unfinished_requests() and not engine.structured_outputs.has_compiling
    assert engine.step() == [] and not engine.structured_outputs.guided


def test_reasoning_is_free_text_then_the_grammar_applies(tmp_path: Any) -> None:
    """With a reasoning parser (qwen3), a sequence whose prompt opens <think> is not masked (nor
    its grammar advanced) until it writes </think>; the tokens after follow the grammar. A
    prompt whose reasoning already ended is masked from its first token."""
    model_dir = build_tool_model(str(tmp_path))
    llm = make_llm(model_dir, reasoning_parser="qwen3")
    tokenizer = llm.get_tokenizer()
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = tokenizer.encode(PROMPTS[0])
    regex = "xy{1,3}z"
    # The bias makes </think> the first token written: allowed while reasoning, masked after.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logit_bias={end_think: 100},
                            structured_outputs=StructuredOutputsParams(regex=regex))
    reasoning, done = llm.generate([{"prompt_token_ids": prompt + [think]},
                                    {"prompt_token_ids": prompt + [think, end_think]}], params, use_tqdm=False)
    out = reasoning.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[0] == end_think
    assert re.fullmatch(regex, tokenizer.decode(out.token_ids[1:-1]))  # then the stop token
    out = done.outputs[0]
    assert out.finish_reason == "stop" and end_think not in out.token_ids
    assert re.fullmatch(regex, tokenizer.decode(out.token_ids[:-1]))


def test_a_token_the_grammar_refuses_fails_its_sequence_alone(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its mask (a bug, made here), a guided sequence samples what its grammar refuses:
    that sequence finishes with "error", and the request beside it is untouched."""
    monkeypatch.setattr(StructuredOutputManager, "bitmask", lambda manager, rows: None)
    llm = make_llm(model_dir)
    guided, plain = llm.generate(PROMPTS[:2], [
        SamplingParams(max_tokens=10, temperature=0, structured_outputs=StructuredOutputsParams(regex="QQ")),
        SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert guided.outputs[0].finish_reason == "error" and len(guided.outputs[0].token_ids) == 1
    assert len(plain.outputs[0].token_ids) == 5


def test_engine_wide_settings(model_dir: str, llm: LLM) -> None:
    """structured_outputs_config (vLLM's keys): disable_any_whitespace for every request gives
    what the per-request flag gives; unknown keys and other backends are refused by name."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    tight = make_llm(model_dir, structured_outputs_config={"disable_any_whitespace": True, "backend": "xgrammar"})
    engine_wide = tight.generate(PROMPTS, SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    per_request = llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))), use_tqdm=False)
    assert tokens(engine_wide) != tokens(llm.generate(PROMPTS, SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False))
    assert tokens(engine_wide) == tokens(per_request)
    with pytest.raises(ValueError, match="no key 'strict'"):
        make_llm(model_dir, structured_outputs_config={"strict": True})
    with pytest.raises(ValueError, match="'guidance' is not available"):
        make_llm(model_dir, structured_outputs_config={"backend": "guidance"})
