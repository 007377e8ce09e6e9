"""The Triton mixture-of-experts kernel (minivllm/kernels/fused_moe.py) against a float64
reference, and its alignment step on its own.

Without CUDA the kernels run in Triton's interpreter (small shapes, fp32/fp16); the
`gpu`-marked tests use Qwen3-30B-A3B's shape (E=128, H=2048, I=768, k=8) in bf16, and a
CUDA graph replayed with new routing.
"""

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.fused_moe import fused_moe, fused_moe_config, moe_align
from tests.conftest import DEVICE

# (atol, rtol) against float64 on outputs of unit scale: fp32 accumulation in another order;
# 16-bit: the intermediate, each slot's output and the sum are each rounded once.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """In float64: for each token t and slot j, e = topk_ids[t, j], g, u = (x @ w13[e].T).chunk(2),
    out[t] += topk_weights[t, j] * (silu(g) * u) @ w2[e].T (all of one expert's rows at once)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = (hidden[tokens].double() @ w13[expert].double().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[expert].double().T
        out.index_add_(0, tokens, topk_weights[tokens, slots].double()[:, None] * y)
    return out


def make_problem(num_tokens: int, num_experts: int, hidden_size: int, inter: int, top_k: int,
                 dtype: torch.dtype, seed: int = 0, used_experts: int | None = None,
                 device: str = DEVICE) -> tuple[torch.Tensor, ...]:
    """Random activations, weights of unit-scale outputs and top-k routing (distinct experts
    per token, as torch.topk gives; only the first used_experts experts are ever picked).
    Returns hidden, w13, w2, topk_weights (renormalised, fp32), topk_ids (int64)."""
    gen = torch.Generator(device).manual_seed(seed)  # on the device: Qwen3-30B's weights are big

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    hidden = randn(num_tokens, hidden_size)
    w13 = randn(num_experts, 2 * inter, hidden_size, scale=hidden_size ** -0.5)
    w2 = randn(num_experts, hidden_size, inter, scale=(2 / inter) ** 0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    if used_experts is not None:
        logits[:, used_experts:] = float("-inf")
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    return hidden, w13, w2, topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids


def check(problem: tuple[torch.Tensor, ...], config: dict[str, int] | None = None) -> None:
    hidden = problem[0]
    out = fused_moe(*problem, config=config)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    atol, rtol = TOL[hidden.dtype]
    torch.testing.assert_close(out.double(), fused_moe_reference(*problem), atol=atol, rtol=rtol)


def check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Every slot once, in its expert's group; groups in expert order, each padded with the
    sentinel to a multiple of block_m; each block's expert right; nothing past the end."""
    sorted_slots, expert_ids, num_padded = (t.cpu() for t in align)
    ids = topk_ids.reshape(-1).cpu()
    num_slots = ids.numel()
    counts = torch.bincount(ids, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert num_padded.tolist() == [int(padded.sum())]
    worst = num_slots + min(num_slots, num_experts) * (block_m - 1)  # every hit expert's group padded
    assert expert_ids.numel() == -(-worst // block_m) and sorted_slots.numel() == expert_ids.numel() * block_m
    start = 0
    for expert in range(num_experts):
        group = sorted_slots[start: start + padded[expert]]
        assert group[: counts[expert]].tolist() == (ids == expert).nonzero().flatten().tolist()
        assert (group[counts[expert]:] == num_slots).all()
        assert (expert_ids[start // block_m: (start + padded[expert]) // block_m] == expert).all()
        start += int(padded[expert])


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,used", [
    (1, 4, 1, 16, None),  # one slot: one block, 15 padding rows
    (3, 8, 2, 16, None),  # most experts get nothing
    (17, 8, 4, 16, 5),  # experts 5..7 never picked
    (64, 4, 2, 16, None),  # 32 slots per expert on average: several blocks per group
    (200, 8, 4, 32, 6),  # several chunks of the alignment kernel's scan
])
def test_alignment(num_tokens, num_experts, top_k, block_m, used):
    topk_ids = make_problem(num_tokens, num_experts, 8, 8, top_k, torch.float32, used_experts=used)[-1]
    check_alignment(topk_ids, num_experts, block_m, moe_align(topk_ids, num_experts, block_m))
    # int32 ids (a router's choice) give the same grouping.
    ids32 = topk_ids.to(torch.int32)
    check_alignment(ids32, num_experts, block_m, moe_align(ids32, num_experts, block_m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,inter,top_k,used", [
    (1, 4, 32, 1, None),  # decode of one token: one expert, one row
    (3, 8, 48, 2, None),  # ragged I (masked columns), most experts idle
    (17, 8, 32, 4, 6),  # two experts never picked
    (64, 4, 48, 2, None),  # several row blocks per expert
    (64, 8, 32, 4, 4),  # every token on the same 4 experts: 64 rows each
])
def test_matches_reference(dtype, num_tokens, num_experts, inter, top_k, used):
    check(make_problem(num_tokens, num_experts, 64, inter, top_k, dtype, used_experts=used))


def test_tiles_and_strides():
    # Tiles smaller than the problem: K loops (H 64 in whole tiles, I 48 in a ragged one),
    # ragged column blocks, GROUP_M ordering over blocks of several experts; a hidden with a
    # row stride wider than H, int32 ids.
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=3, num_warps=4, num_stages=2)
    hidden, w13, w2, weights, ids = make_problem(40, 8, 64, 48, 2, torch.float32, seed=1)
    wide = torch.zeros(40, 96, device=DEVICE)
    wide[:, :64] = hidden
    check((wide[:, :64], w13, w2, weights, ids.to(torch.int32)), config)


def test_config_table():
    # Each expert gets about T * k / E rows: taller row blocks only for bigger batches.
    sizes = (1, 16, 64, 256, 1024, 4096, 8192, 100_000)
    block_ms = [fused_moe_config(t, torch.bfloat16)["BLOCK_M"] for t in sizes]
    assert block_ms == sorted(block_ms) and block_ms[0] == 16
    # fp32 tiles take as many bytes of shared memory as 16-bit ones.
    for t in sizes:
        half, full = fused_moe_config(t, torch.float16), fused_moe_config(t, torch.float32)
        assert full == {**half, "BLOCK_K": half["BLOCK_K"] // 2}


# ----------------------------------------------------------------------------------------- GPU

QWEN3_30B = dict(num_experts=128, hidden_size=2048, inter=768, top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,dtype", [
    (1, torch.bfloat16), (7, torch.bfloat16), (64, torch.bfloat16), (256, torch.bfloat16),
    (2048, torch.bfloat16),
    (7, torch.float32), (256, torch.float32),  # the model tests' dtype: other tiles (BLOCK_K)
])
def test_qwen3_30b_shape(num_tokens, dtype):
    problem = make_problem(num_tokens, dtype=dtype, device="cuda", **QWEN3_30B)
    block_m = fused_moe_config(num_tokens, dtype)["BLOCK_M"]
    check_alignment(problem[-1], 128, block_m, moe_align(problem[-1], 128, block_m))
    check(problem)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_routing():
    num_tokens = 16
    static = make_problem(num_tokens, dtype=torch.bfloat16, device="cuda", **QWEN3_30B)
    block_m = fused_moe_config(num_tokens, torch.bfloat16)["BLOCK_M"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        fused_moe(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        align = moe_align(static[-1], 128, block_m)
        out = fused_moe(*static)
    for seed in (1, 2):
        # Same weights, new activations and routing (one seed routes everything to 8 experts).
        fresh = make_problem(num_tokens, dtype=torch.bfloat16, device="cuda", seed=seed,
                             used_experts=8 if seed == 2 else None, **QWEN3_30B)
        for dst, src in zip((static[0], static[3], static[4]), (fresh[0], fresh[3], fresh[4])):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_alignment(static[-1], 128, block_m, align)
        atol, rtol = TOL[torch.bfloat16]
        torch.testing.assert_close(out.double(), fused_moe_reference(*static), atol=atol, rtol=rtol)
