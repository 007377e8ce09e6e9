"""The torch backend's batched attention against the naive float64 reference (tests/conftest.py):
decodes in one padded call, prompt chunks one call each, GQA folded into the query rows."""

import pytest
import torch

from minivllm.attention.torch_backend import TorchAttentionBackend, to_cache_dtype
from tests.conftest import ATTENTION_TOL, DEVICE, reference_attention
from tests.test_triton_kernels import make_batch, make_meta, random_cache, random_q

# Leading decodes of unequal contexts (one inside a single page), prompt chunks over cached
# prefixes and without, a one-token chunk after them (not a leading decode) and an empty one.
Q_LENS = [1, 1, 1, 1, 17, 40, 1, 0, 9]
SEQ_LENS = [37, 130, 5, 64, 50, 40, 67, 12, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)])
def test_matches_reference(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> None:
    block_size, head_dim = 16, 64
    qsl, lens, table, num_blocks = make_batch(Q_LENS, SEQ_LENS, block_size, share_blocks=1)
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = random_q(sum(Q_LENS), num_q_heads, head_dim, dtype)
    meta = make_meta(qsl, lens, table, slot_mapping=None)
    assert meta.num_leading_decodes == 4
    backend = TorchAttentionBackend()
    ref = reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.125)
    atol, rtol = ATTENTION_TOL[dtype]
    for _ in range(2):  # the second layer of a step reuses the first's plan
        out = backend.attend(q, k_cache, v_cache, meta, 0.125)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_fp8_cache_is_widened_to_the_query_dtype() -> None:
    block_size, num_kv_heads, head_dim = 16, 2, 64
    qsl, lens, table, num_blocks = make_batch(Q_LENS, SEQ_LENS, block_size)
    k_cache, v_cache = (to_cache_dtype(c * 8, torch.float8_e4m3fn)
                        for c in random_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32))
    q = random_q(sum(Q_LENS), 4, head_dim, torch.float16)
    out = TorchAttentionBackend().attend(q, k_cache, v_cache, make_meta(qsl, lens, table, None), 0.125)
    assert out.dtype == torch.float16
    atol, rtol = ATTENTION_TOL[torch.float16]
    torch.testing.assert_close(out.double(), reference_attention(q, k_cache, v_cache, qsl, lens, table, 0.125),
                               atol=atol, rtol=rtol)


def test_slots_past_the_contexts_are_never_read() -> None:
    """Padding a decode to the longest context reads no slot past its own: NaN there (a
    never-written page, a stale one) leaves every output finite and exact."""
    block_size, num_kv_heads, head_dim = 16, 2, 64
    q_lens, seq_lens = [1, 1, 1, 20], [70, 3, 33, 20]
    qsl, lens, table, num_blocks = make_batch(q_lens, seq_lens, block_size)
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    ref = reference_attention(q := random_q(sum(q_lens), 4, head_dim, torch.float32),
                              k_cache, v_cache, qsl, lens, table, 0.125)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    for b, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=DEVICE)
        written[table[b, positions // block_size].long() * block_size + positions % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~written] = float("nan")
    out = TorchAttentionBackend().attend(q, k_cache, v_cache, make_meta(qsl, lens, table, None), 0.125)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
