"""What prefix-aware routing buys across data-parallel replicas: the prefix-cache hit rate of two
loads served by two replicas (DataParallelAsyncLLM) routed three ways.

    python -m benchmarks.dp_routing [--model tiny|PRESET|DIR] [--scale 0.25]

Loads (all requests greedy, ignore_eos):
- W3: W3's requests (a shared prefix and distinct suffixes: benchmarks/prefix_cache.py, --scale
  as there), all sent at once.
- chat: --conversations conversations of --turns turns, run side by side, each turn sent a
  while (uniform in 0 .. 2 x --think-time) after the one before it has answered: a shared
  system prompt, then per turn a new user message of its own, the prompt being the whole
  conversation so far (earlier answers included, so a turn's prompt starts with the previous
  turn's prompt and answer). Without the pause, a replica that just answered is the least busy
  one when the next turn comes, and routing by load alone keeps conversations in place.
Routing: "prefix" (the engine's PrefixRouter), "load" (the replica with the fewest unfinished
requests, as a balancer that never looks at prompts), and "one engine" (one replica: one cache,
the best any routing can do). The hit rate is prompt tokens found cached over prompt tokens
looked up, summed over the replicas, for the load alone; requests per replica show the balance.

The routing, not the model, decides what is cached: on the CPU, "--model tiny" (a two-layer
Qwen3 of width 64 with the demo tokenizer, random weights) measures it in a minute or two.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import Request, add_common_args, engine_kwargs, random_prompt, report, resolve_model
from benchmarks.prefix_cache import w3_requests
from minivllm.config import EngineConfig
from minivllm.engine.data_parallel import DataParallelAsyncLLM, PrefixRouter, Router
from minivllm.sampling_params import SamplingParams

SYSTEM_PROMPT_LEN = 256
USER_MESSAGE_LEN = 96
ANSWER_LEN = 32


class LeastBusyRouter:
    """The live replica with the fewest unfinished requests (ties to the lowest rank)."""

    def choose(self, token_ids: Sequence[int], loads: list[int | None]) -> int:
        return min((load, rank) for rank, load in enumerate(loads) if load is not None)[1]


class CountingRouter:
    """Another router's choices, counted per replica."""

    def __init__(self, router: Router, num_replicas: int) -> None:
        self.router = router
        self.counts = [0] * num_replicas

    def choose(self, token_ids: Sequence[int], loads: list[int | None]) -> int:
        rank = self.router.choose(token_ids, loads)
        self.counts[rank] += 1
        return rank


def tiny_model_dir() -> str:
    """A two-layer Qwen3 of width 64 with the demo tokenizer (config only: random weights)."""
    from transformers import Qwen3Config

    from minivllm.local_models import EOS_TOKEN, build_tokenizer

    path = tempfile.mkdtemp(prefix="minivllm-dp-routing-")
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=len(tokenizer), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=8192,
                bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(path)
    return path


async def run_w3(engine: DataParallelAsyncLLM, requests: list[Request]) -> None:
    async def one(request: Request) -> None:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": request.prompt_token_ids}, params):
            pass

    await asyncio.gather(*(one(request) for request in requests))


async def run_chat(engine: DataParallelAsyncLLM, args: argparse.Namespace, vocab_size: int) -> None:
    conversations, turns, scale = args.conversations, args.turns, args.scale
    rng = random.Random(0)
    system = random_prompt(rng, max(1, int(SYSTEM_PROMPT_LEN * scale)), vocab_size)
    messages = [[random_prompt(rng, max(1, int(USER_MESSAGE_LEN * scale)), vocab_size) for _ in range(turns)]
                for _ in range(conversations)]
    params = SamplingParams(max_tokens=max(1, int(ANSWER_LEN * scale)), temperature=0, ignore_eos=True)

    async def conversation(user_messages: list[list[int]], pauses: random.Random) -> None:
        history = list(system)
        for message in user_messages:
            await asyncio.sleep(pauses.uniform(0, 2 * args.think_time))
            history += message
            answer: list[int] = []
            async for output in engine.generate({"prompt_token_ids": list(history)}, params):
                answer = list(output.outputs[0].token_ids)
            history += answer

    await asyncio.gather(*(conversation(user_messages, random.Random(i)) for i, user_messages in enumerate(messages)))


def measure(config: EngineConfig, replicas: int, router: Router, load: str, args: argparse.Namespace,
            vocab_size: int) -> dict[str, Any]:
    counting = CountingRouter(router, replicas)
    engine = DataParallelAsyncLLM(config, replicas, log_stats_interval_s=None, router=counting)
    try:
        before = [replica.engine_stats() for replica in engine.replicas]
        start = time.perf_counter()
        if load == "W3":
            asyncio.run(run_w3(engine, w3_requests(args.scale, vocab_size)))
        else:
            asyncio.run(run_chat(engine, args, vocab_size))
        seconds = time.perf_counter() - start
        after = [replica.engine_stats() for replica in engine.replicas]
    finally:
        engine.shutdown()
    queries = sum(a["prefix_cache_queries"] - b["prefix_cache_queries"] for a, b in zip(after, before))
    hits = sum(a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before))
    return {"hit_rate": round(hits / queries, 4) if queries else 0.0, "prompt_tokens": queries,
            "cached_tokens": hits, "seconds": round(seconds, 2),
            "requests_per_replica": counting.counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--think-time", type=float, default=0.5, help="mean pause (s) before each turn")
    parser.add_argument("--loads", nargs="+", default=["W3", "chat"], choices=["W3", "chat"])
    parser.set_defaults(model="tiny")
    args = parser.parse_args()
    tiny = args.model == "tiny"
    spec = resolve_model(tiny_model_dir() if tiny else args.model, "dummy" if tiny else args.load_format)
    config = EngineConfig(spec.path, **engine_kwargs(args, spec))
    for load in args.loads:
        results = {"prefix": measure(config, 2, PrefixRouter(2, config.block_size), load, args, spec.vocab_size),
                   "load": measure(config, 2, LeastBusyRouter(), load, args, spec.vocab_size),
                   "one engine": measure(config, 1, PrefixRouter(1, config.block_size), load, args,
                                         spec.vocab_size)}
        report(f"DP routing, {load}", "minivllm", args, results)


if __name__ == "__main__":
    main()
