"""lm-eval against `minivllm serve`: a multiple-choice task from local files, scored through the
server by lm-eval's `local-completions` (echo + logprobs; the tokenizer the server's own, through
/tokenizer_info, /tokenize and /detokenize), gives the accuracy and every log-likelihood that
lm-eval's `hf` backend gives on the same SmolLM2 in transformers."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import lm_eval
import pytest
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager

from tests.server_utils import RemoteServer, serving

pytestmark = pytest.mark.slow  # the real SmolLM2, served and in transformers

TASK = "minivllm_mini_mc"
# Some the model gets right, some not (5 of 8 in float32).
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], 1),
    ("Which planet is known as the Red Planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What is the boiling point of water at sea level in Celsius?", ["50", "90", "120", "100"], 3),
    ("What color is the sky on a clear day?", ["Blue", "Green", "Red", "Yellow"], 0),
    ("Which animal says 'moo'?", ["Dog", "Cow", "Cat", "Duck"], 1),
    ("What is 2 + 2?", ["3", "5", "4", "22"], 2),
    ("Which language is spoken in Brazil?", ["Spanish", "French", "English", "Portuguese"], 3),
]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory: pytest.TempPathFactory) -> TaskManager:
    """The task as a user writes one: a YAML config over a local JSONL file (no hub)."""
    directory = tmp_path_factory.mktemp("lm_eval_task")
    data = directory / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (directory / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {directory / "datasets_cache"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    # include_defaults=False: index this task alone, not lm-eval's thousands.
    return TaskManager(include_path=str(directory), include_defaults=False)


@pytest.fixture(scope="module")
def server(gguf_path: str) -> Iterator[RemoteServer]:
    with serving(gguf_path, "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--disable-log-stats",
                 "--enable-tokenizer-info-endpoint", stop_signal=signal.SIGINT) as server:
        yield server


def evaluate(task_manager: TaskManager, model: str | LocalCompletionsAPI,
             model_args: dict[str, Any] | None = None) -> tuple[float, list[Any]]:
    """The task's accuracy and, per question, its choices' (log-likelihood, is greedy) pairs."""
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=task_manager,
                                      log_samples=True, bootstrap_iters=0)
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(QUESTIONS)
    return results["results"][TASK]["acc,none"], [sample["filtered_resps"] for sample in samples]


def test_local_completions_with_the_remote_tokenizer_matches_hf(server: RemoteServer, task_manager: TaskManager,
                                                                gguf_path: str) -> None:
    # lm-eval's default tokenizer backend ("auto") is the server's tokenizer where /tokenizer_info
    # and /tokenize answer. batch_size 8: each request scores 8 prompts (as token ids).
    served_model = LocalCompletionsAPI(model="tiny", base_url=f"{server.url}/v1/completions", batch_size=8,
                                       max_retries=1, max_length=512)
    assert served_model.tokenizer_backend == "remote"
    served_accuracy, served = evaluate(task_manager, served_model)
    hf_accuracy, expected = evaluate(task_manager, "hf", {
        "pretrained": os.path.dirname(gguf_path), "gguf_file": os.path.basename(gguf_path), "dtype": "float32",
        "device": "cpu", "batch_size": 32})
    assert served_accuracy == hf_accuracy
    for served_choices, expected_choices in zip(served, expected):
        assert [is_greedy for _, is_greedy in served_choices] == [is_greedy for _, is_greedy in expected_choices]
        assert [loglikelihood for loglikelihood, _ in served_choices] == pytest.approx(
            [loglikelihood for loglikelihood, _ in expected_choices], abs=1e-3)
