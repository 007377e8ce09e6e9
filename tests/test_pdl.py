"""Programmatic dependent launch: on where it pays, and a chain of dependent kernels gives the
same result launched eagerly and replayed from a CUDA graph (where PDL's early starts overlap)."""

import pytest
import torch

from minivllm.kernels import fused_ops, pdl
from minivllm.kernels.pdl import pdl_enabled
from minivllm.kernels.skinny_matmul import skinny_matmul


def test_pdl_off_on_cpu():
    assert not pdl_enabled(torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_dependent_chain_graphed_equals_eager(monkeypatch: pytest.MonkeyPatch):
    """Twenty layers' worth of norm -> matmul -> activation -> matmul, each kernel reading the
    one before it (and the residual written three kernels back): any kernel that ran ahead of
    its wait would change the result. Replayed on fresh inputs, the graph must give what the
    eager chain gives, bit for bit, and both what the same kernels give launched without PDL."""
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] >= 9:
        assert pdl_enabled(device)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter = 1024, 3072
    up = [torch.randn(2 * inter, hidden, device=device, generator=gen, dtype=torch.bfloat16) / 32
          for _ in range(20)]
    down = [torch.randn(hidden, inter, device=device, generator=gen, dtype=torch.bfloat16) / 55
            for _ in range(20)]
    norm_weight = torch.rand(hidden, device=device, generator=gen, dtype=torch.bfloat16) + 0.5
    x_in = torch.empty(1, hidden, device=device, dtype=torch.bfloat16)
    residual_in = torch.empty_like(x_in)

    def chain() -> torch.Tensor:
        x, residual = x_in, residual_in.clone()
        for w_up, w_down in zip(up, down):
            normed, residual = fused_ops.add_rms_norm(x, residual, norm_weight, 1e-6)
            x = skinny_matmul(fused_ops.silu_and_mul(skinny_matmul(normed, w_up)), w_down)
        return x + residual

    def fresh_inputs(seed: int) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        x_in.copy_(torch.randn(x_in.shape, device=device, generator=g))
        residual_in.copy_(torch.randn(x_in.shape, device=device, generator=g))

    fresh_inputs(1)
    chain()  # compiles every kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_out = chain()
    results = []
    for seed in range(2, 7):
        fresh_inputs(seed)
        want = chain().clone()
        graph.replay()
        assert torch.equal(graphed_out, want), seed
        results.append(want)
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)
    for seed, want in zip(range(2, 7), results):
        fresh_inputs(seed)
        assert torch.equal(chain(), want), seed
