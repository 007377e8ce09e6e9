"""FP8 experts in the Triton mixture-of-experts kernel (kernels/fused_moe.py with Fp8Experts):
FusedMoE built with the Triton kernels against the same layer built with torch (its loop over
the experts, each dequantised), from the same FP8 tensors, in every scheme the checkpoints
have: weights per output channel (per tensor spread over them) or per block, activations
quantised per token (per token and block of columns), by a static scale, or not at all.

Both paths quantise each projection's input the same way (the layer's Fp8LinearMethod), so
they differ only by the order of fp32 sums, and where that moves an intermediate value
across an FP8 rounding boundary: a handful of elements off by one FP8 step.
"""

import pytest
import torch

from minivllm.layers.custom_op import use_triton_kernels
from minivllm.layers.fp8_linear import fp8_linear_layers
from minivllm.layers.fused_moe import FusedMoE
from minivllm.quantization import Fp8Config
from tests.conftest import DEVICE
from tests.fp8_checkpoints import Fp8Scheme, quantize_weight

SCHEMES = {
    # Qwen3-*-FP8's format (128x128 there; small here): blocks that cut the intermediate (48) and
    # leave a partial one at the end of each of gate and up, and of down's K.
    "fp8-block": Fp8Scheme("fp8", "block", "dynamic", (32, 32)),
    "ct-block-weight-only": Fp8Scheme("compressed-tensors", "block", "none", (16, 32)),
    "ct-channel-dynamic": Fp8Scheme("compressed-tensors", "channel", "dynamic"),
    "ct-tensor-static": Fp8Scheme("compressed-tensors", "tensor", "static"),
    "ct-channel-weight-only": Fp8Scheme("compressed-tensors", "channel", "none"),
    "online": None,  # quantization="fp8": per channel, quantised at load
}
INPUT_SCALES = (0.02, 0.03)  # static: w13's input, w2's
# (atol, rtol) on outputs of about unit scale: fp32 sums in another order, a few intermediate
# elements one FP8 step apart (2 ** -3 of the element relative, one term of I in each output).
TOL = {torch.float32: (2e-3, 2e-3), torch.float16: (3e-2, 2e-2), torch.bfloat16: (6e-2, 5e-2)}


def fp8_config(scheme: Fp8Scheme | None) -> Fp8Config:
    if scheme is None:
        return Fp8Config(None, None, "dynamic")
    block = scheme.block if scheme.weights == "block" else None
    return Fp8Config(scheme.checkpoint_format, block, scheme.activations)  # type: ignore[arg-type]


def build_pair(scheme: Fp8Scheme | None, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
               seed: int = 0) -> tuple[FusedMoE, FusedMoE]:
    """(torch layer, Triton layer), each loaded with the same FP8 experts (from random weights of
    outputs about unit scale), on DEVICE in dtype."""
    gen = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=gen) * hidden ** -0.5 for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=gen) * (2 / inter) ** 0.5
    config = fp8_config(scheme)
    layers = []
    for triton in (False, True):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with use_triton_kernels(triton), fp8_linear_layers(config):
                layer = FusedMoE(num_experts, hidden, inter)
        finally:
            torch.set_default_dtype(default_dtype)
        for expert in range(num_experts):
            for param, weight, shard, input_scale in ((layer.w13, gate, 0, INPUT_SCALES[0]),
                                                      (layer.w13, up, 1, INPUT_SCALES[0]),
                                                      (layer.w2, down, None, INPUT_SCALES[1])):
                if scheme is None:
                    layer.weight_loader(param, weight[expert], (expert, shard))
                    continue
                name = "w13" if param is layer.w13 else "w2"
                quantized, scale, _ = quantize_weight(weight[expert], scheme)
                layer.weight_loader(param, quantized, (expert, shard))
                layer.weight_loader(getattr(layer, f"{name}_{config.weight_scale_name}"), scale, (expert, shard))
                if scheme.activations == "static":
                    layer.weight_loader(getattr(layer, f"{name}_input_scale"), torch.tensor(input_scale),
                                        (expert, shard))
        layers.append(layer.to(DEVICE))
    return layers[0], layers[1]


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as top-k picks them), renormalised float32 weights."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def check(scheme: Fp8Scheme | None, num_tokens: int, top_k: int, dtype: torch.dtype, num_experts: int = 8,
          hidden: int = 64, inter: int = 48) -> None:
    native, triton = build_pair(scheme, num_experts, hidden, inter, dtype)
    assert triton.w13.dtype == triton.w2.dtype == torch.float8_e4m3fn
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, seed=2)
    want, got = native(x, weights, ids), triton(x, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (7, 2), (64, 4)])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_triton_fp8_experts_match_the_torch_loop(name: str, num_tokens: int, top_k: int) -> None:
    check(SCHEMES[name], num_tokens, top_k, torch.float32)


@pytest.mark.parametrize("name", ["fp8-block", "ct-channel-dynamic", "ct-channel-weight-only"])
def test_half_precision(name: str) -> None:
    check(SCHEMES[name], 7, 2, torch.float16)


@pytest.mark.parametrize("name", ["fp8-block", "ct-channel-dynamic"])
def test_prefill_tiles(name: str) -> None:
    """The largest tiles (128 x 128, which block scales halve to 128 x 64 for gate and up) on a
    small problem: the layer's output."""
    from minivllm.kernels.fused_moe import fused_moe

    native, triton = build_pair(SCHEMES[name], 8, 64, 48, torch.float32)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, ids = routing(40, 8, 2, seed=2)
    config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
    got = fused_moe(x, triton.w13, triton.w2, weights, ids, config=config, fp8=triton.fp8_experts())
    torch.testing.assert_close(got, native(x, weights, ids), atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


def test_block_columns_the_kernel_cannot_tile_are_refused() -> None:
    with use_triton_kernels(True), fp8_linear_layers(Fp8Config("fp8", (16, 40), "dynamic")), \
            pytest.raises(ValueError, match="16x40 weight blocks are not a multiple of 16 columns"):
        FusedMoE(4, 80, 32)


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256])
@pytest.mark.parametrize("name", ["qwen3-fp8-block", "ct-channel-dynamic", "ct-channel-weight-only"])
def test_qwen3_30b_shape_in_bfloat16(name: str, num_tokens: int) -> None:
    """Qwen3-30B-A3B's experts (E=128, H=2048, I=768, top-8) in bfloat16: 128x128 blocks as the
    published FP8 checkpoint has them, or per channel."""
    scheme = (Fp8Scheme("fp8", "block", "dynamic", (128, 128)) if name == "qwen3-fp8-block" else SCHEMES[name])
    check(scheme, num_tokens, 8, torch.bfloat16, num_experts=128, hidden=2048, inter=768)


@pytest.mark.gpu
def test_cuda_graph_replay() -> None:
    """The FP8 layer (activation quantisation and kernels) captured in a CUDA graph replays
    with new inputs and routing."""
    native, triton = build_pair(Fp8Scheme("fp8", "block", "dynamic", (128, 128)), 16, 256, 128, torch.bfloat16)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(8, 16, 4, seed=3)
    triton(x, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton(x, weights, ids)
    for seed in (4, 5):
        x.copy_(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16))
        new_weights, new_ids = routing(8, 16, 4, seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        atol, rtol = TOL[torch.bfloat16]
        torch.testing.assert_close(out.float(), native(x, weights, ids).float(), atol=atol, rtol=rtol)
