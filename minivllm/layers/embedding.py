"""Vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary."""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import all_reduce, gather_to_rank0, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0) -> None:
        shard = loaded[self.vocab_start:self.vocab_start + self.local_vocab]
        param.data.zero_()
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.local_vocab)
        y = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        return all_reduce(y * in_shard.unsqueeze(-1).to(y.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    # None on ranks other than 0, unlike an embedding's forward: the logits are gathered there only.
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        """Full-vocabulary logits on rank 0 (None elsewhere)."""
        logits = gather_to_rank0(F.linear(hidden, self.weight))
        return logits[..., :self.vocab_size] if logits is not None else None
