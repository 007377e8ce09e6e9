"""The engine on the Triton attention backend, run on CPU through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU): the same kernels and runner
paths as on the GPU (mixed prefill, split-KV decode, cascade), checked against HF."""

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.hf_oracle import hf_greedy

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs these paths natively (-m gpu)"),
              pytest.mark.slow]  # whole engine steps in Triton's interpreter


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("Qwen3ForCausalLM")


def greedy_outputs(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_chunked_prefill_and_decode_match_hf(model_dir: str) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (1, 7, 8, 9, 30)]
    llm = LLM(model_dir, dtype="float32", max_model_len=64, block_size=8, kernels="triton",
              max_num_batched_tokens=12)
    assert greedy_outputs(llm, prompts, 6) == [hf_greedy(model_dir, p, 6)[0] for p in prompts]


def test_cascade_attention_for_a_shared_prefix(model_dir: str, cascade_calls: list[int]) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(3, 700) for _ in range(40)]  # five 8-token blocks
    prompts = [shared + [rng.randrange(3, 700) for _ in range(n)] for n in (1, 4, 9)]
    llm = LLM(model_dir, dtype="float32", max_model_len=96, block_size=8, kernels="triton")
    assert greedy_outputs(llm, prompts, 6) == [hf_greedy(model_dir, p, 6)[0] for p in prompts]
    assert cascade_calls, "the cascade path was not taken"


def test_cascade_for_the_decodes_of_mixed_steps(model_dir: str, cascade_calls: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences decoding beside others' prompt chunks (a mixed step) read their shared
    prefix through the cascade too, and still match HF."""
    from minivllm.attention.triton_backend import TritonAttentionBackend

    mixed_cascades = []
    attend = TritonAttentionBackend.attend

    def spy(self, q, k_cache, v_cache, meta, scale):
        if meta.num_shared_prefix_blocks is not None and not meta.is_decode_only:
            mixed_cascades.append(meta.max_query_len)
        return attend(self, q, k_cache, v_cache, meta, scale)

    monkeypatch.setattr(TritonAttentionBackend, "attend", spy)
    rng = random.Random(4)
    shared = [rng.randrange(3, 700) for _ in range(40)]  # five 8-token blocks
    prompts = [shared + [rng.randrange(3, 700) for _ in range(n)] for n in (3, 5, 9, 2, 12)]
    # 16-token steps: the later prompts' chunks share steps with the earlier ones' decodes.
    llm = LLM(model_dir, dtype="float32", max_model_len=96, block_size=8, kernels="triton",
              max_num_batched_tokens=16)
    assert greedy_outputs(llm, prompts, 6) == [hf_greedy(model_dir, p, 6)[0] for p in prompts]
    assert mixed_cascades, "no mixed step took the cascade for its decodes"


@pytest.mark.parametrize("arch", ["llama3-rope-scaling", "qwen2"])
def test_architectures_without_qk_norm_match_hf(arch: str, tiny_model_factory) -> None:
    """The fused attention-input kernel without Qwen3's q/k norms (RoPE + KV store only)."""
    from tests.test_generate_hf import ARCHITECTURES

    architecture, overrides = ARCHITECTURES[arch]
    model_dir = tiny_model_factory(architecture, **overrides)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (2, 11, 20)]
    llm = LLM(model_dir, dtype="float32", max_model_len=64, block_size=8, kernels="triton")
    assert greedy_outputs(llm, prompts, 5) == [hf_greedy(model_dir, p, 5)[0] for p in prompts]


@pytest.mark.parametrize("few_seqs", [1, 4])  # prefill graphs of 6 sequence rows, or of 4
def test_padded_steps_compute_what_unpadded_steps_do(model_dir: str, few_seqs: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What the CUDA graphs run, here eagerly: a step padded to a graph's shape (empty
    sequences, tokens stored nowhere) gives the logits of the same step unpadded."""
    from minivllm.engine.scheduler_output import NewSequenceData, SchedulerOutput
    from minivllm.executor import cuda_graphs
    from minivllm.executor.cuda_graphs import StepGraphs, graph_metadata

    monkeypatch.setattr(cuda_graphs, "PREFILL_GRAPH_FEW_SEQS", few_seqs)

    llm = LLM(model_dir, dtype="float32", max_model_len=64, block_size=8, kernels="triton",
              max_num_seqs=6, max_num_batched_tokens=40)
    runner = llm.llm_engine.model_runner
    graphs = runner.graphs = StepGraphs(runner.model, runner.buffers, 6, 64, 40)  # never captured on CPU
    device = runner.buffers.device

    def replay(shape: tuple[int, int], kind: str) -> torch.Tensor:
        tokens, rows = shape
        meta = graph_metadata(runner.buffers, rows, tokens, 64, kind)
        return runner.model(device.input_ids[:tokens], device.positions[:tokens], meta)
    graphs.replay = replay
    shapes = []

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (5, 9, 13)]
    runner.update_states(SchedulerOutput(new_seqs=[
        NewSequenceData(i, prompt, SamplingParams(), None, [2 * i, 2 * i + 1]) for i, prompt in enumerate(prompts)]))
    states = runner.batch.states
    computed = [0] * len(prompts)

    def step(order: list[int], new_tokens: list[int]) -> None:
        samples = [computed[i] + n == len(states[i].token_ids) for i, n in zip(order, new_tokens)]
        rows = runner.batch.rows(SchedulerOutput(order, new_tokens, [computed[i] for i in order], samples))
        shapes.append(graphs.padded_shape(rows.num_tokens, len(rows.states), rows.num_decodes))
        eager, _ = runner.execute_model(runner.prepare_inputs(rows))
        padded, _ = runner.execute_model(runner.prepare_inputs(rows, shapes[-1]))
        # fp32 on the CPU: torch's GEMMs may round differently for 3 rows than for 4 (a few
        # 1e-5 on these logits); a padding error moves logits by orders of magnitude more.
        torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
        for i, n in zip(order, new_tokens):
            computed[i] += n

    step([0, 1], [5, 6])  # prefill: 11 tokens in a 16-token graph
    step([1, 2], [3, 13])  # the rest of a chunked prompt and a whole prompt: 16 tokens
    for state, token in zip(states.values(), (17, 23, 29)):
        state.token_ids.append(token)
    step([0, 1, 2], [1, 1, 1])  # decode: a batch of 3 in the graph of 4
    rows = 6 if few_seqs == 1 else 4
    assert shapes == [(16, rows), (16, rows), (4, 4)]
    # Decodes at the front of a mixed step run eagerly, through the split-KV decode kernel;
    # so does a step too big for every graph.
    assert graphs.padded_shape(6, 2, 1) is None and graphs.padded_shape(2057, 2, 0) is None


@pytest.mark.parametrize("kernel", ["skinny_matmul", "batch_matmul"])
def test_small_batch_linear_kernels_in_the_engine_match_hf(model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                           kernel: str) -> None:
    """Every linear layer routed to one kernel, as choose_small_batch_kernels routes the weights
    where it serves them better than cuBLAS on a GPU: steps of up to ROUTED_ROWS tokens take
    skinny_matmul, of MIN_ROWS to MAX_ROWS batch_matmul (decode steps, and here the prompt steps
    too), bigger ones F.linear, and the tokens still match HF. K is split wherever it can be, so the
    o and down projections hand their unreduced partial sums to the add-RMSNorm after them."""
    from minivllm.kernels import batch_matmul, skinny_matmul
    from minivllm.kernels.split_k import SplitKPartials
    from minivllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    rows_seen: list[int] = []
    partials_seen: list[bool] = []  # per call: whether it left partial sums

    def spy(real):
        def call(x, *args, **kwargs):
            rows_seen.append(x.shape[0])
            out = real(x, *args, **kwargs)
            partials_seen.append(isinstance(out, SplitKPartials))
            return out
        return call

    if kernel == "skinny_matmul":
        module, rows_range, num_prompts = skinny_matmul, (1, skinny_matmul.ROUTED_ROWS), 3
        for name in ("skinny_matmul", "skinny_matmul_partials", "skinny_matmul_silu_and_mul"):
            monkeypatch.setattr(skinny_matmul, name, spy(getattr(skinny_matmul, name)))
        real_config = skinny_matmul.skinny_matmul_config
        monkeypatch.setattr(skinny_matmul, "skinny_matmul_config",  # the tiny model's K in two splits
                            lambda *args: {**real_config(*args), "BLOCK_K": 16, "SPLIT_K": 2})
    else:
        module, rows_range, num_prompts = batch_matmul, (batch_matmul.MIN_ROWS, batch_matmul.MAX_ROWS), 6
        for name in ("batch_matmul", "batch_matmul_silu_and_mul"):
            monkeypatch.setattr(batch_matmul, name, spy(getattr(batch_matmul, name)))
        real_config = batch_matmul.batch_matmul_config

        def split_config(dtype, n, k, device, partial_sums, *rest):
            # The tiny model's K in two splits where partial sums are wanted (else outputs must be whole).
            return {**real_config(dtype, n, k, device, partial_sums, *rest), "BLOCK_K": 16,
                    "SPLIT_K": 2 if partial_sums else 1}
        monkeypatch.setattr(batch_matmul, "batch_matmul_config", split_config)
    llm = LLM(model_dir, dtype="float32", max_model_len=64, block_size=8, kernels="triton")
    for layer in llm.llm_engine.model_runner.model.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            setattr(layer, "use_skinny" if module is skinny_matmul else "use_batch_matmul", True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (3, 11, 6, 9, 4, 7)[:num_prompts]]
    assert greedy_outputs(llm, prompts, 5) == [hf_greedy(model_dir, p, 5)[0] for p in prompts]
    assert rows_seen and all(rows_range[0] <= rows <= rows_range[1] for rows in rows_seen)
    # Per layer, qkv and gate_up give their output (gate_up's through SiLU-and-mul), o and down
    # (row-parallel) partial sums.
    assert partials_seen.count(True) == partials_seen.count(False) > 0


def test_partial_sums_past_64_rows_in_the_engine_match_hf(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of 65-192 sequences: the row-parallel o and down projections take batch_matmul
    (tiles of 64 rows, K split, partial sums for the add-RMSNorm), qkv and gate_up F.linear, and
    the tokens still match HF."""
    from minivllm.kernels import batch_matmul
    from minivllm.kernels.split_k import SplitKPartials
    from minivllm.layers.linear import RowParallelLinear

    wide_partials: list[int] = []
    real = batch_matmul.batch_matmul

    def spy(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        if x.shape[0] > batch_matmul.MAX_ROWS and isinstance(out, SplitKPartials):
            wide_partials.append(x.shape[0])
        return out

    monkeypatch.setattr(batch_matmul, "batch_matmul", spy)
    llm = LLM(model_dir, dtype="float32", max_model_len=32, block_size=8, kernels="triton", max_num_seqs=80)
    for layer in llm.llm_engine.model_runner.model.modules():
        if isinstance(layer, RowParallelLinear):
            assert layer.partial_sums
            layer.use_batch_matmul = True
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 700) for _ in range(rng.randint(1, 3))] for _ in range(70)]
    assert greedy_outputs(llm, prompts, 3) == [hf_greedy(model_dir, p, 3)[0] for p in prompts]
    assert wide_partials and all(rows <= batch_matmul.PARTIAL_SUMS_MAX_ROWS for rows in wide_partials)


def test_speculative_decoding_verify_steps_match_hf(tiny_model_factory) -> None:
    """Rows that verify draft tokens (several query tokens at the end of a context) beside
    decodes, through the mixed and decode kernels; a 16-token vocabulary, so that prompt
    lookup's drafts are often right."""
    model_dir = tiny_model_factory("Qwen3ForCausalLM", vocab_size=16)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 16) for _ in range(5)] * 3 for _ in range(3)]
    llm = LLM(model_dir, dtype="float32", max_model_len=64, block_size=8, kernels="triton",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    assert greedy_outputs(llm, prompts, 16) == [hf_greedy(model_dir, p, 16)[0] for p in prompts]
    assert llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > 0
