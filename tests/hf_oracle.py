"""Hugging Face transformers as the correctness oracle: greedy continuation and logprobs."""

import functools

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@functools.lru_cache(maxsize=8)
def load_hf_model(model_dir: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt_token_ids: list[int], max_tokens: int
              ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (never stopping at EOS) and the log-softmax at each generated position."""
    return _hf_greedy(model_dir, tuple(prompt_token_ids), max_tokens)


@functools.lru_cache(maxsize=4096)  # tests ask for the same continuation many times
@torch.no_grad()
def _hf_greedy(model_dir: str, prompt_token_ids: tuple[int, ...], max_tokens: int
               ) -> tuple[list[int], list[torch.Tensor]]:
    model = load_hf_model(model_dir)
    ids = list(prompt_token_ids)
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        # Full recompute each step: slow but version-proof, and the models are tiny.
        logits = model(torch.tensor([ids])).logits[0, -1]
        step_logprobs = torch.log_softmax(logits.float(), dim=-1)
        token = int(step_logprobs.argmax())
        tokens.append(token)
        logprobs.append(step_logprobs)
        ids.append(token)
    return tokens, logprobs


@functools.lru_cache(maxsize=64)
@torch.no_grad()
def hf_prompt_logprobs(model_dir: str, prompt_token_ids: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i the log-softmax after the prompt's first i + 1 tokens, the
    distribution prompt token i + 1 was drawn from."""
    logits = load_hf_model(model_dir)(torch.tensor([prompt_token_ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)
