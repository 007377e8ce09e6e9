"""FP8 weights: checkpoints of both formats (tests/fp8_checkpoints.py writes them from tiny
models) generate what transformers generates from the dequantised weights, with each
quantised layer's input rounded to FP8 as the scheme says; quantization="fp8" quantises a
checkpoint at load; other quantisation configs are refused, naming what is wrong."""

import json
import os
import re
import shutil

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from tests.fp8_checkpoints import Fp8Scheme, fake_quantize, hf_fp8_greedy, quantize_weight, write_fp8_checkpoint
from tests.hf_oracle import load_hf_model
from tests.test_generate_hf import mixed_prompts, run

MAX_TOKENS = 10
# Static activation scales (llm-compressor calibrates them; any positive values make a checkpoint):
# q/k/v and gate/up differ, so their packed layers must take the largest.
INPUT_SCALES = {"q_proj": 0.012, "k_proj": 0.015, "v_proj": 0.01, "o_proj": 0.008,
                "gate_proj": 0.011, "up_proj": 0.013, "down_proj": 0.02}

CHECKPOINTS = {
    # Qwen3-*-FP8: 128x128 blocks in the real ones; 32x32 here, where layers are 32 to 128 wide.
    "fp8-block": ("Qwen3ForCausalLM", Fp8Scheme("fp8", "block", "dynamic", (32, 32))),
    # Blocks that do not divide the layers: each packed part's last block is partial.
    "fp8-block-partial": ("LlamaForCausalLM", Fp8Scheme("fp8", "block", "dynamic", (48, 40))),
    "fp8-tensor-static": ("Qwen3ForCausalLM", Fp8Scheme("fp8", "tensor", "static")),
    # llm-compressor's FP8_DYNAMIC (with Qwen2's q/k/v biases), FP8 and FP8_BLOCK, and weights only.
    "ct-channel-dynamic": ("Qwen2ForCausalLM", Fp8Scheme("compressed-tensors", "channel", "dynamic")),
    "ct-tensor-static": ("LlamaForCausalLM", Fp8Scheme("compressed-tensors", "tensor", "static")),
    "ct-block": ("Qwen3ForCausalLM", Fp8Scheme("compressed-tensors", "block", "dynamic", (32, 32))),
    "ct-weight-only": ("Qwen3ForCausalLM", Fp8Scheme("compressed-tensors", "channel", "none")),
    # Qwen3-MoE (top-2 of 8 experts in every layer), its experts' projections in FP8 too.
    "moe-fp8-block": ("Qwen3MoeForCausalLM", Fp8Scheme("fp8", "block", "dynamic", (16, 32))),
    "moe-ct-tensor-static": ("Qwen3MoeForCausalLM", Fp8Scheme("compressed-tensors", "tensor", "static")),
    "moe-ct-weight-only": ("Qwen3MoeForCausalLM", Fp8Scheme("compressed-tensors", "channel", "none")),
}


def make_llm(model_dir: str, **kwargs: object) -> LLM:
    return LLM(model_dir, **{"dtype": "float32", "max_model_len": 128, "block_size": 8, **kwargs})


def prompts_for(model_dir: str) -> list[list[int]]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return mixed_prompts(json.load(f)["vocab_size"])[3:8]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fp8_checkpoint_matches_the_dequantised_model(name: str, tiny_model_factory, tmp_path) -> None:
    architecture, scheme = CHECKPOINTS[name]
    fp8_dir, oracle_dir = write_fp8_checkpoint(tiny_model_factory(architecture), str(tmp_path), scheme, INPUT_SCALES)
    llm = make_llm(fp8_dir)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    down = layer.mlp.experts.w2 if architecture == "Qwen3MoeForCausalLM" else layer.mlp.down_proj.weight
    assert down.dtype == torch.float8_e4m3fn
    prompts = prompts_for(fp8_dir)
    assert run(llm, prompts, MAX_TOKENS) == hf_fp8_greedy(oracle_dir, scheme, prompts, MAX_TOKENS, INPUT_SCALES)


def test_online_fp8_matches_per_channel_quantisation(tiny_model_factory, tmp_path) -> None:
    """quantization="fp8" on a float32 checkpoint: per-channel weight scales, dynamic per-token
    activations, the function of a per-channel FP8 checkpoint (the oracle); and near the
    unquantised model on the same contexts (the prompts' tokens, scored)."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    scheme = Fp8Scheme("compressed-tensors", "channel", "dynamic")
    _, oracle_dir = write_fp8_checkpoint(model_dir, str(tmp_path), scheme)
    prompts = mixed_prompts(768, seed=3)
    fp8 = make_llm(model_dir, quantization="fp8")
    assert run(fp8, prompts, MAX_TOKENS) == hf_fp8_greedy(oracle_dir, scheme, prompts, MAX_TOKENS)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    by_fp8 = fp8.generate(inputs, scored, use_tqdm=False)
    by_full = make_llm(model_dir).generate(inputs, scored, use_tqdm=False)
    deltas, same_top1 = [], []
    for prompt, a, b in zip(prompts, by_fp8, by_full):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        for token, at_a, at_b in zip(prompt[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert at_a is not None and at_b is not None
            deltas.append(abs(at_a[token].logprob - at_b[token].logprob))
            same_top1.append(min(at_a, key=lambda t: at_a[t].rank or 0) == min(at_b, key=lambda t: at_b[t].rank or 0))
    agreement, mean_delta = sum(same_top1) / len(same_top1), sum(deltas) / len(deltas)
    print(f"online fp8 vs float32 over {len(deltas)} prompt positions: top-1 agreement {agreement:.3f}, "
          f"|delta logprob| mean {mean_delta:.4f} max {max(deltas):.4f}")
    # Measured: 0.80 and 0.95 (max 6.3). The tiny random model is that sensitive by design (logits of
    # std 8): its weights alone, rounded per channel, move prompt logprobs by 0.78 on average.
    assert agreement >= 0.7 and mean_delta < 1.5


@pytest.mark.parametrize("scheme", [Fp8Scheme("fp8", "block", "dynamic", (16, 16)),
                                    Fp8Scheme("compressed-tensors", "channel", "dynamic"),
                                    Fp8Scheme("compressed-tensors", "tensor", "static"),
                                    None])  # quantised at load
def test_a_layer_slices_weights_and_scales_for_each_rank_alike(scheme: Fp8Scheme | None) -> None:
    """Tensor parallelism's slicing, one rank at a time (faked tp_rank and tp_size, no processes):
    each rank's packed column-parallel layer gives its rows of the whole layer's output, and each
    rank's row-parallel layer, fed its slice of the input, that slice's product with its columns
    of the weight."""
    from unittest import mock

    from minivllm.layers import fp8_linear
    from minivllm.layers.linear import QKVParallelLinear, RowParallelLinear
    from minivllm.quantization import Fp8Config

    torch.manual_seed(0)
    config = (Fp8Config(None, None, "dynamic") if scheme is None
              else Fp8Config(scheme.checkpoint_format, scheme.block if scheme.weights == "block" else None,
                             scheme.activations))
    q, k, v = (torch.randn(n, 64) / 8 for n in (64, 32, 32))
    o = torch.randn(64, 64) / 8
    x = torch.randn(5, 64)

    def load(layer: torch.nn.Module, weight: torch.Tensor, part: int, projection: str) -> None:
        if scheme is None:
            layer.weight_loader(layer.weight, weight, part)
            return
        quantized, scale, _ = quantize_weight(weight, scheme)
        layer.weight_loader(layer.weight, quantized, part)
        layer.weight_loader(getattr(layer, config.weight_scale_name), scale, part)
        if scheme.activations == "static":
            layer.weight_loader(layer.input_scale, torch.tensor(INPUT_SCALES[projection]), part)

    def build(rank: int, tp: int) -> tuple[QKVParallelLinear, RowParallelLinear]:
        patches = [mock.patch(f"minivllm.layers.{module}.{name}", return_value=value)
                   for module in ("linear", "fp8_linear") for name, value in (("tp_rank", rank), ("tp_size", tp))]
        for patch in patches:
            patch.start()
        try:
            with fp8_linear.fp8_linear_layers(config):
                qkv, row = QKVParallelLinear(64, 16, 4, 2), RowParallelLinear(64, 64)
            for part, (weight, projection) in enumerate(zip((q, k, v), ("q_proj", "k_proj", "v_proj"))):
                load(qkv, weight, part, projection)
            load(row, o, 0, "o_proj")
        finally:
            for patch in patches:
                patch.stop()
        return qkv, row

    whole_qkv, whole_row = build(0, 1)
    shards = [build(rank, 2) for rank in range(2)]
    heads = [torch.cat([part.chunk(2, dim=-1)[rank] for part in whole_qkv(x).split([64, 32, 32], dim=-1)], dim=-1)
             for rank in range(2)]
    for rank, (qkv, _) in enumerate(shards):
        torch.testing.assert_close(qkv(x), heads[rank], rtol=1e-6, atol=1e-6)
    # A row-parallel rank quantises its own slice of the input (per token: with its own scales, as
    # vLLM's ranks do), and multiplies by its columns of the weight.
    weights = scheme or Fp8Scheme("compressed-tensors", "channel", "dynamic")  # what quantization="fp8" does
    o_dequantized = quantize_weight(o, weights)[2]
    group = weights.block[1] if weights.weights == "block" else None
    for row, columns in [(whole_row, slice(0, 64))] + [(row, slice(32 * r, 32 * r + 32)) for r, (_, row) in
                                                      enumerate(shards)]:
        x_rounded = fake_quantize(x[:, columns], weights.activations, group, INPUT_SCALES["o_proj"])
        torch.testing.assert_close(row(x[:, columns]), x_rounded @ o_dequantized[:, columns].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization_config,error", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "weight_block_size needs activation_scheme 'dynamic'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}},
     "config_groups.group_0.weights (type 'int'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "group"}}}},
     "weights.strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": False}}}},
     "input_activations (strategy 'token', dynamic False)"),
])
def test_other_quantisation_configs_are_refused(quantization_config: dict, error: str, tiny_model_factory,
                                                tmp_path) -> None:
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model_factory("Qwen3ForCausalLM"), model_dir)
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=re.escape(error)):
        EngineConfig(model_dir)


def test_quantization_argument_is_checked(tiny_model_factory, tmp_path) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        EngineConfig(model_dir, quantization="awq")
    with pytest.raises(ValueError, match="has no quantization_config"):
        EngineConfig(model_dir, quantization="compressed-tensors")
    fp8_dir, _ = write_fp8_checkpoint(model_dir, str(tmp_path), Fp8Scheme("fp8", "block", "dynamic", (32, 32)))
    with pytest.raises(ValueError, match="quant_method 'fp8', which does not match quantization='compressed-tensors'"):
        EngineConfig(fp8_dir, quantization="compressed-tensors")
    assert EngineConfig(fp8_dir, quantization="fp8").fp8_config == EngineConfig(fp8_dir).fp8_config


@pytest.mark.parametrize("checkpoint_format", ["compressed-tensors", "fp8"])
def test_layers_the_checkpoint_leaves_unquantised(checkpoint_format: str, tiny_model_factory, tmp_path) -> None:
    """Modules an FP8 checkpoint's ignore list (modules_to_not_convert) names, by name or regular
    expression, stay in the model dtype."""
    ignored = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
               "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    ignore = ignored[:3] + [r"re:.*layers\.1\.mlp\.down_proj$"]
    scheme = Fp8Scheme(checkpoint_format, "block" if checkpoint_format == "fp8" else "channel", "dynamic", (32, 32))
    fp8_dir, oracle_dir = write_fp8_checkpoint(tiny_model_factory("Qwen3ForCausalLM"), str(tmp_path), scheme,
                                               ignored=ignored, ignore=ignore)
    llm = make_llm(fp8_dir)
    layers = llm.llm_engine.model_runner.model.model.layers
    assert layers[0].self_attn.qkv_proj.weight.dtype == layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    prompts = prompts_for(fp8_dir)
    assert run(llm, prompts, MAX_TOKENS) == hf_fp8_greedy(oracle_dir, scheme, prompts, MAX_TOKENS, ignored=ignored)
    # Part of a packed layer left unquantised: refused.
    part_dir, _ = write_fp8_checkpoint(tiny_model_factory("Qwen3ForCausalLM"), str(tmp_path / "part"), scheme,
                                       ignored=ignored[1:2])
    with pytest.raises(ValueError, match=re.escape("leaves model.layers.0.self_attn.k_proj unquantised but not "
                                                   "model.layers.0.self_attn.q_proj")):
        make_llm(part_dir)


def test_unquantised_layers_in_an_fp8_checkpoint_are_refused(tiny_model_factory, tmp_path) -> None:
    """A checkpoint weight in 16/32 bits that the ignore list does not name fails at load."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    fp8_dir, oracle_dir = write_fp8_checkpoint(model_dir, str(tmp_path), Fp8Scheme("compressed-tensors", "channel",
                                                                                  "dynamic"))
    from safetensors.torch import load_file, save_file
    path = os.path.join(fp8_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = load_file(os.path.join(oracle_dir, "model.safetensors"))[name]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="does not leave its layer unquantised"):
        make_llm(fp8_dir)


def test_online_fp8_moe_matches_per_channel_quantisation(tiny_model_factory, tmp_path) -> None:
    """quantization="fp8" quantises the experts too, from a checkpoint of transformers' packed experts."""
    model_dir = tiny_model_factory("Qwen3MoeForCausalLM")
    packed_dir = str(tmp_path / "packed")
    shutil.copytree(model_dir, packed_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    load_hf_model(model_dir).save_pretrained(packed_dir, save_original_format=False)
    scheme = Fp8Scheme("compressed-tensors", "channel", "dynamic")
    _, oracle_dir = write_fp8_checkpoint(model_dir, str(tmp_path / "fp8"), scheme)
    prompts = prompts_for(model_dir)
    llm = make_llm(packed_dir, quantization="fp8")
    assert llm.llm_engine.model_runner.model.model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert run(llm, prompts, MAX_TOKENS) == hf_fp8_greedy(oracle_dir, scheme, prompts, MAX_TOKENS)


@pytest.mark.slow  # engine steps in Triton's interpreter
@pytest.mark.parametrize("name", ["moe-fp8-block", "moe-ct-tensor-static", "online"])
def test_fp8_moe_in_triton_matches_torch(name: str, tiny_model_factory, tmp_path) -> None:
    """kernels='triton' (on CPU through Triton's interpreter: a short run): the FP8 experts in the
    fused kernel, block-scaled dense layers in kernels/fp8_matmul.py, generate the torch loop's
    tokens."""
    model_dir = tiny_model_factory("Qwen3MoeForCausalLM")
    if name == "online":
        fp8_dir, kwargs = model_dir, {"quantization": "fp8"}
    else:
        fp8_dir, _ = write_fp8_checkpoint(model_dir, str(tmp_path), CHECKPOINTS[name][1], INPUT_SCALES)
        kwargs = {}
    prompts = prompts_for(fp8_dir)[:2]
    want = run(make_llm(fp8_dir, **kwargs), prompts, 4)
    assert run(make_llm(fp8_dir, kernels="triton", **kwargs), prompts, 4) == want


def block_layers(scheme: Fp8Scheme, rows: int, columns: int, dtype: torch.dtype, device: str
                 ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(torch, Triton) ColumnParallelLinear with a bias, loaded with the same block-scaled weights."""
    from minivllm.layers import fp8_linear
    from minivllm.layers.custom_op import use_triton_kernels
    from minivllm.layers.linear import ColumnParallelLinear
    from minivllm.quantization import Fp8Config

    gen = torch.Generator().manual_seed(0)
    quantized, scale, _ = quantize_weight(torch.randn(rows, columns, generator=gen) / columns ** 0.5, scheme)
    bias = torch.randn(rows, generator=gen)
    config = Fp8Config(scheme.checkpoint_format, scheme.block, scheme.activations)  # type: ignore[arg-type]
    layers = []
    for triton in (False, True):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with use_triton_kernels(triton), fp8_linear.fp8_linear_layers(config):
                layer = ColumnParallelLinear(columns, [rows], bias=True)
        finally:
            torch.set_default_dtype(default_dtype)
        layer.weight_loader(layer.weight, quantized)
        layer.weight_loader(getattr(layer, config.weight_scale_name), scale)
        layer.weight_loader(layer.bias, bias)
        layers.append(layer.to(device))
    return layers[0], layers[1]


@pytest.mark.parametrize("num_rows", [1, 7, 64, 130])
@pytest.mark.parametrize("scheme", [Fp8Scheme("fp8", "block", "dynamic", (32, 32)),
                                    Fp8Scheme("compressed-tensors", "block", "none", (16, 32))])
def test_triton_block_matmul_computes_the_reference(scheme: Fp8Scheme, num_rows: int) -> None:
    """Block-scaled dense layers with the Triton kernels (kernels/fp8_matmul.py; on CPU through
    Triton's interpreter): the reference's function, blocks partial at the end of both dimensions."""
    from tests.conftest import DEVICE

    reference, triton = block_layers(scheme, 80, 96, torch.float32, DEVICE)
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.testing.assert_close(triton(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 16, 64, 256, 2048])
def test_triton_block_matmul_in_bfloat16(num_rows: int) -> None:
    """128x128 blocks at a Qwen3 layer's shape in bfloat16 on the GPU."""
    reference, triton = block_layers(Fp8Scheme("fp8", "block", "dynamic", (128, 128)), 4096, 2048,
                                     torch.bfloat16, "cuda")
    x = torch.randn(num_rows, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(triton(x).float(), reference(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.slow  # tensor-parallel worker processes
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_tensor_parallel_fp8_checkpoint(architecture: str, tiny_model_factory, tmp_path) -> None:
    """TP=2 on CPU (gloo): block scales sliced with their weights (the experts' too) give TP=1's
    tokens; blocks a shard would cut are refused."""
    model_dir = tiny_model_factory(architecture)
    scheme = Fp8Scheme("fp8", "block", "dynamic", (16, 16))  # each rank's 16 KV rows: whole blocks
    fp8_dir, oracle_dir = write_fp8_checkpoint(model_dir, str(tmp_path / "aligned"), scheme)
    prompts = prompts_for(fp8_dir)
    want = hf_fp8_greedy(oracle_dir, scheme, prompts, MAX_TOKENS)
    assert run(make_llm(fp8_dir), prompts, MAX_TOKENS) == want
    tp2 = make_llm(fp8_dir, tensor_parallel_size=2)
    try:
        assert run(tp2, prompts, MAX_TOKENS) == want
    finally:
        tp2.shutdown()
    cut_dir, _ = write_fp8_checkpoint(model_dir, str(tmp_path / "cut"), Fp8Scheme("fp8", "block", "dynamic", (32, 32)))
    with pytest.raises(ValueError, match="splits a layer's 32 output rows into shards of 16, which cut the "
                                         "checkpoint's 32x32 weight blocks"):
        make_llm(cut_dir, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [Fp8Scheme("compressed-tensors", "channel", "dynamic"),
                                    Fp8Scheme("compressed-tensors", "tensor", "static")])
def test_scaled_mm_computes_the_reference(scheme: Fp8Scheme) -> None:
    """On CUDA, per-channel/per-tensor weights multiply on FP8 tensor cores (torch._scaled_mm):
    the function the CPU reference computes."""
    from minivllm.layers import fp8_linear
    from minivllm.layers.linear import ColumnParallelLinear
    from minivllm.quantization import Fp8Config

    torch.manual_seed(0)
    weight, x = torch.randn(256, 512) / 20, torch.randn(33, 512, dtype=torch.bfloat16)
    quantized, scale, _ = quantize_weight(weight, scheme)
    outputs = []
    default_dtype = torch.get_default_dtype()
    for device in ("cpu", "cuda"):
        torch.set_default_dtype(torch.bfloat16)  # the bias's, as the engine builds a bfloat16 model
        try:
            with torch.device(device), fp8_linear.fp8_linear_layers(
                    Fp8Config(scheme.checkpoint_format, None, scheme.activations)):
                layer = ColumnParallelLinear(512, [256], bias=True)
        finally:
            torch.set_default_dtype(default_dtype)
        layer.weight_loader(layer.weight, quantized)
        layer.weight_loader(layer.weight_scale, scale)
        if scheme.activations == "static":
            layer.weight_loader(layer.input_scale, torch.tensor(0.01))
        layer.weight_loader(layer.bias, torch.randn(256, generator=torch.Generator().manual_seed(1)))
        outputs.append(layer(x.to(device)).float().cpu())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=2e-2, atol=2e-2)


def test_dummy_weights_in_fp8(tiny_model_factory) -> None:
    """load_format="dummy" (speed tests) fills FP8 weights too; their scales stay 1."""
    llm = make_llm(tiny_model_factory("Qwen3ForCausalLM"), load_format="dummy", quantization="fp8")
    qkv = llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.float().abs().max() > 0 and bool((qkv.weight_scale == 1).all())
    assert len(run(llm, [[1, 2, 3]], 4)[0]) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8-block", "ct-channel-dynamic", "moe-fp8-block", "moe-ct-tensor-static"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: torch._scaled_mm for per-channel scales
def test_fp8_checkpoint_on_the_gpu(name: str, dtype: str, tiny_model_factory, tmp_path) -> None:
    """FP8 layers in the GPU engine (Triton kernels, CUDA graphs): the graphs replay what eager steps
    compute, and in float32 the tokens are the oracle's (GPU matmuls round otherwise than the CPU's,
    which may move an activation across an FP8 rounding boundary: most prompts, not all)."""
    architecture, scheme = CHECKPOINTS[name]
    fp8_dir, oracle_dir = write_fp8_checkpoint(tiny_model_factory(architecture), str(tmp_path), scheme, INPUT_SCALES)
    prompts = prompts_for(fp8_dir)
    kwargs = {"dtype": dtype, "gpu_memory_utilization": 0.3, "max_num_seqs": 16}
    graphs, eager = (run(make_llm(fp8_dir, enforce_eager=eager, **kwargs), prompts, MAX_TOKENS)
                     for eager in (False, True))
    assert graphs == eager
    if dtype == "float32":
        want = hf_fp8_greedy(oracle_dir, scheme, prompts, MAX_TOKENS, INPUT_SCALES)
        assert sum(got == expected for got, expected in zip(graphs, want)) >= 0.8 * len(prompts)
