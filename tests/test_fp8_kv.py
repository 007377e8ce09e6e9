"""The FP8 (e4m3) KV cache: the stores saturate and round as torch does, and the attention
kernels read FP8 pages against the float64 reference over the same FP8 values.

Triton's interpreter handles float8_e4m3fn loads, stores and conversions, so the kernels
run in CI with fp32/fp16 queries (bf16 only on the GPU: the interpreter mishandles it). It
rounds float -> e4m3 otherwise than the GPU and torch (round to nearest even), so on CPU
the fused store is checked on values e4m3 holds exactly, on the GPU on any.
"""

import random

import pytest
import torch
import triton
import triton.language as tl

from minivllm import LLM
from minivllm.attention.torch_backend import store_kv, to_cache_dtype
from minivllm.kernels import attention_tiles, decode_attention, fused_ops, mixed_attention
from tests.conftest import ATTENTION_TOL, DEVICE, reference_attention
from tests.test_cascade_attention import CascadeBatch
from tests.test_fused_ops import make_rope, reference_rope
from tests.test_triton_kernels import make_batch, random_q

FP8 = torch.float8_e4m3fn


def fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V pages in FP8, with values across e4m3's range (|x| up to ~40)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return tuple(to_cache_dtype(torch.randn(shape, generator=g) * 8, FP8).to(DEVICE) for _ in range(2))


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The reference reads the same FP8 values, so the kernels' tolerance is the query dtype's."""
    atol, rtol = ATTENTION_TOL[dtype]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_store_saturates_and_rounds() -> None:
    """e4m3 has no infinity: out-of-range values saturate to +-448 instead of becoming NaN."""
    x = torch.tensor([[[1000.0, -1000.0, 0.3, 447.9, 1e-4, -3.3]]])
    k_cache = torch.zeros(2, 2, 1, 6, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    store_kv(x, -x, k_cache, v_cache, torch.tensor([3]))
    stored = k_cache.view(-1, 6)[3].float()
    assert stored.tolist()[:2] == [448.0, -448.0]
    assert torch.equal(stored, x.clamp(-448, 448).to(FP8).float().view(6))
    assert torch.equal(v_cache.view(-1, 6)[3].float(), -stored)
    assert k_cache.view(-1, 6)[[0, 1, 2]].float().abs().sum() == 0  # other slots untouched


def run_fused_store(dtype: torch.dtype, representable: bool) -> None:
    """qk_norm_rope_store into an FP8 cache against torch's RoPE then store_kv, byte for
    byte, saturation included (|v| reaches past 448). representable: position 0 (RoPE is the
    identity) and K/V values e4m3 holds exactly, apart from the saturated ones, so that no
    rounding is involved."""
    num_tokens, hq, hkv, head_dim, block_size = 9, 4, 2, 16, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(num_tokens, heads, head_dim, generator=g) * 4 for heads in (hq, hkv, hkv))
    v[::2, 0, :3] = torch.tensor([1000.0, -600.0, 449.0])
    positions = torch.randint(0, 32, (num_tokens,), generator=g)
    if representable:
        k, v = (x.clamp(-448, 448).to(FP8).float() + (x - x.clamp(-448, 448)) for x in (k, v))
        positions.zero_()
    q, k, v = (x.to(dtype).to(DEVICE) for x in (q, k, v))
    positions, cos_sin = positions.to(DEVICE), make_rope(head_dim, 32)
    slots = torch.randperm(4 * block_size, generator=g)[:num_tokens]
    slots[1::4] = -1
    slots = slots.to(DEVICE)
    k_cache = torch.zeros(4, block_size, hkv, head_dim, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    ref_q, ref_k = reference_rope(positions, q.clone(), k.clone(), cos_sin)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    store_kv(ref_k, v, ref_k_cache, ref_v_cache, slots)
    fused_ops.qk_norm_rope_store(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert torch.equal(q, ref_q)
    assert ref_v_cache.float().abs().max() == 448
    assert torch.equal(k_cache.view(torch.uint8), ref_k_cache.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_store_saturates_as_torch(dtype: torch.dtype) -> None:
    run_fused_store(dtype, representable=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_fused_store_rounds_as_torch(dtype: torch.dtype) -> None:
    """Any values: the GPU rounds to nearest even, as torch (the interpreter does not)."""
    run_fused_store(dtype, representable=False)


# Head dims: the value tiles' column order (kernels/attention_tiles.py) depends on D.
@pytest.mark.parametrize("head_dim", [32, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_lens,seq_lens", [
    ([5, 33, 1, 70], [5, 33, 1, 70]),  # ragged prompts
    ([1, 20, 1, 9], [37, 60, 100, 9]),  # decodes beside chunks over cached prefixes
])
def test_mixed_kernel_reads_fp8(dtype: torch.dtype, q_lens: list[int], seq_lens: list[int], head_dim: int) -> None:
    qsl, lens, table, num_blocks = make_batch(q_lens, seq_lens, 16, share_blocks=1)
    k_cache, v_cache = fp8_cache(num_blocks, 16, 2, head_dim)
    q = random_q(sum(q_lens), 4, head_dim, dtype)
    out = mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, 0.125)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.125), dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_reads_fp8(dtype: torch.dtype, num_splits: int, head_dim: int) -> None:
    seq_lens = [1, 300, 17, 129]
    qsl, lens, table, num_blocks = make_batch([1] * 4, seq_lens, 16, share_blocks=1)
    k_cache, v_cache = fp8_cache(num_blocks, 16, 2, head_dim)
    q = random_q(4, 8, head_dim, dtype)
    out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, 0.125, num_splits)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.125), dtype)


def test_decode_tiles_read_fp8() -> None:
    """decode_config's FP8 tiles (32 keys, one warp, five stages) over a D=128 cache; the
    interpreter runs the tile shapes, not the warps or stages."""
    config = decode_attention.decode_config(128, torch.bfloat16, FP8, 64)
    seq_lens = [1, 300, 17, 129]
    qsl, lens, table, num_blocks = make_batch([1] * 4, seq_lens, 16, share_blocks=1)
    k_cache, v_cache = fp8_cache(num_blocks, 16, 2, 128)
    q = random_q(4, 4, 128, torch.float16)
    out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, 0.1, 1, config=config)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.1), torch.float16)


def test_fp8_decode_splits_fill_the_sms_with_one_warp_programs() -> None:
    """The FP8 tiles are one warp each, so a launch aims for more of them per SM than for the
    16-bit tiles: at 64 sequences (512 contexts on 132 SMs) those split every context in two."""
    fp8 = decode_attention.decode_config(128, torch.bfloat16, FP8, 64)
    bf16 = decode_attention.decode_config(128, torch.bfloat16, torch.bfloat16, 64)
    assert (fp8.tiles.block_n, fp8.tiles.num_warps) == (32, 1) and fp8.programs_per_sm > bf16.programs_per_sm
    splits = [decode_attention.decode_num_splits(64, 8, 4096, 132, c.programs_per_sm) for c in (fp8, bf16)]
    assert splits == [2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("suffix_splits", [1, 2])  # own keys merged in their launch, or by the reduce
def test_cascade_kernel_reads_fp8(dtype: torch.dtype, suffix_splits: int) -> None:
    batch = CascadeBatch([1, 33, 12, 64], 4, 16, 4, 2, 64, dtype, seed=5)
    batch.k_cache, batch.v_cache = (to_cache_dtype(c.float() * 8, FP8) for c in (batch.k_cache, batch.v_cache))
    check(batch.cascade(prefix_splits=2, suffix_splits=suffix_splits), batch.reference(), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("decode,num_seqs", [(False, 48), (True, 1), (True, 48), (True, 128)])
def test_gpu_bf16_queries_over_fp8_cache(decode: bool, num_seqs: int) -> None:
    """Qwen3-like heads (16 q / 8 kv, D 128), contexts up to 4k, bf16 queries; decode
    batches of one, some and many sequences."""
    gen = random.Random(5)
    seq_lens = [gen.randint(1, 4096) for _ in range(num_seqs)]
    q_lens = [1] * num_seqs if decode else [1] * 40 + [min(n, 300) for n in seq_lens[40:]]
    qsl, lens, table, num_blocks = make_batch(q_lens, seq_lens, 16, share_blocks=4)
    k_cache, v_cache = fp8_cache(num_blocks, 16, 8, 128)
    q = random_q(sum(q_lens), 16, 128, torch.bfloat16)
    if decode:
        out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, 128 ** -0.5, 4)
    else:
        out = mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, lens, table, 128 ** -0.5)
    check(out, reference_attention(q, k_cache, v_cache, qsl, lens, table, 128 ** -0.5), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(16, 8), (8, 8), (32, 4), (16, 1)])
def test_gpu_fp8_decode_kernel(block_size: int, num_q_heads: int, num_kv_heads: int) -> None:
    """kernels/fp8_decode.py (decode_config's choice on a GPU) over GQA groups of 1 to 16 and
    several block sizes: contexts from 1 key to past a tile, ragged ends, empty (padded) rows,
    one split and several."""
    assert decode_attention.decode_config(128, torch.bfloat16, FP8, 4).tiles is None  # the Gluon kernel
    gen = random.Random(block_size + num_q_heads)
    seq_lens = [1, 31, 32, 33, 100, gen.randint(1, 2000), gen.randint(1, 2000), 0]
    qsl, lens, table, num_blocks = make_batch([1] * len(seq_lens), seq_lens, block_size)
    k_cache, v_cache = fp8_cache(num_blocks, block_size, num_kv_heads, 128, seed=block_size)
    q = random_q(len(seq_lens), num_q_heads, 128, torch.bfloat16)
    ref = reference_attention(q, k_cache, v_cache, qsl, lens, table, 128 ** -0.5)
    for num_splits in (1, 3, 8):
        out = decode_attention.paged_attention_decode(q, k_cache, v_cache, lens, table, 128 ** -0.5, num_splits)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the empty row
        check(out[:-1], ref[:-1], torch.bfloat16)


# --- the engine with kv_cache_dtype="fp8" --------------------------------------------------

def fp8_llm(model_dir: str, kernels: str = "torch", **kwargs: object) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128, block_size=8, kernels=kernels, **kwargs)


def test_fp8_cache_holds_four_times_the_fp32_tokens(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    memory = 1 << 20
    blocks = {dtype: fp8_llm(model_dir, kv_cache_dtype=dtype, kv_cache_memory_bytes=memory)
              .llm_engine.model_runner.num_blocks for dtype in ("auto", "fp8")}
    assert blocks["fp8"] == 4 * blocks["auto"]


def hf_logprobs_over_fp8_kv(model_dir: str, prompt: list[int], monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """transformers' Qwen3 (fp32) with every key (after RoPE) and value rounded to e4m3 as
    the cache stores them: the next token's log-softmax."""
    from transformers.models.qwen3 import modeling_qwen3

    from tests.hf_oracle import load_hf_model

    model = load_hf_model(model_dir)
    rope = modeling_qwen3.apply_rotary_pos_emb

    def rope_then_round_keys(q: torch.Tensor, k: torch.Tensor, *args: object, **kwargs: object):
        q, k = rope(q, k, *args, **kwargs)
        return q, to_cache_dtype(k, FP8).to(k.dtype)

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", rope_then_round_keys)
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: to_cache_dtype(out, FP8).to(out.dtype))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.log_softmax(logits.float(), dim=-1)


def test_fp8_engine_matches_hf_over_the_same_rounded_kv(tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy with an FP8 cache, against transformers with its keys and values rounded to
    e4m3 the same way: the same first-token logprobs (to fp32 rounding), and the same tokens
    whether prompts are chunked, hit the prefix cache or not."""
    import random

    from minivllm import SamplingParams

    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    rng = random.Random(0)
    prompts = [[rng.randrange(700) for _ in range(n)] for n in (30, 45, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    plain = fp8_llm(model_dir, kv_cache_dtype="fp8", enable_prefix_caching=False)
    outputs = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        reference = hf_logprobs_over_fp8_kv(model_dir, prompt, monkeypatch)
        for token, logprob in output.outputs[0].logprobs[0].items():
            assert abs(logprob.logprob - reference[token].item()) < 1e-3
    chunked = fp8_llm(model_dir, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    for _ in range(2):  # the second pass reads the first's cached blocks
        again = chunked.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert again[0].num_cached_tokens > 0


@pytest.mark.gpu
def test_gpu_fp8_triton_kernels_match_torch_on_the_engine(tiny_model_factory) -> None:
    """The engine's Triton path against its torch path, both over an FP8 cache (fp32 model):
    the same greedy tokens. GPU only: the interpreter rounds into e4m3 otherwise than torch,
    and on a tiny random model one flipped bit of a cached value can flip a token."""
    from minivllm import SamplingParams

    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    results = [[o.outputs[0].token_ids for o in fp8_llm(model_dir, kernels, kv_cache_dtype="fp8")
                .generate(prompts, params, use_tqdm=False)] for kernels in ("torch", "triton")]
    assert results[0] == results[1]


def test_unknown_kv_cache_dtype_is_refused(tiny_model_factory) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported"):
        fp8_llm(tiny_model_factory("Qwen3ForCausalLM"), kv_cache_dtype="int4")


@triton.jit
def _widen_kernel(src, dst, ROWS: tl.constexpr, D: tl.constexpr):
    rows = tl.arange(0, ROWS)
    tile = attention_tiles.dim_order(
        attention_tiles.load_e4m3_value_tile(src, rows * D, rows < ROWS, ROWS, D, False), ROWS, D)
    tl.store(dst + rows[:, None] * D + tl.arange(0, D)[None, :], tile)


@pytest.mark.parametrize("rows,head_dim", [(32, 16), (4, 128)])
def test_value_tiles_widen_every_e4m3_value_exactly(rows: int, head_dim: int) -> None:
    """The value tiles' FP8 -> fp16 widening (4-byte words; bit moves in the interpreter, the
    hardware conversion on a GPU) against torch's, for all 254 e4m3 values but NaN, signed zeros
    included, in every byte position of a word; the tile's columns put back in order (D=16 has
    one column group, so its order is the identity; D=128 has eight)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F, 0xFF: NaN
    tile = torch.cat([codes, codes.flip(0), codes[:4]]).view(rows, head_dim).view(FP8).to(DEVICE)  # 512 bytes
    out = torch.zeros(rows, head_dim, dtype=torch.float16, device=DEVICE)
    _widen_kernel[(1,)](tile, out, rows, head_dim)
    assert torch.equal(out.view(torch.int16), tile.to(torch.float16).view(torch.int16))
