"""The GPU path (Triton attention, CUDA graphs) against Hugging Face and the torch backend."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.hf_oracle import hf_greedy
from tests.test_generate_hf import ARCHITECTURES, expected, mixed_prompts, run, vocab

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_llm(model_dir: str, **kwargs: object) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": 8, "gpu_memory_utilization": 0.3,
              "max_num_seqs": 16, **kwargs}
    return LLM(model_dir, **kwargs)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_fp32_greedy_matches_hf(arch: str, tiny_model_factory) -> None:
    architecture, overrides = ARCHITECTURES[arch]
    model_dir = tiny_model_factory(architecture, **overrides)
    prompts = mixed_prompts(vocab(model_dir), seed=11)
    want = expected(model_dir, prompts, max_tokens=20)
    block_bytes = gpu_llm(model_dir, enforce_eager=True).llm_engine.model_runner._kv_bytes_per_block()
    for kwargs in ({}, {"enforce_eager": True}, {"max_num_batched_tokens": 13},
                   {"kv_cache_memory_bytes": 20 * block_bytes, "max_num_batched_tokens": 13}):
        llm = gpu_llm(model_dir, **kwargs)
        assert run(llm, prompts, max_tokens=20) == want, kwargs
        assert run(llm, prompts, max_tokens=20) == want, kwargs  # second run: prefix-cache hits
        print(arch, kwargs, llm.llm_engine.stats())


def test_bf16_first_step_logits_match_torch_backend(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM", dtype=torch.bfloat16)
    prompts = mixed_prompts(vocab(model_dir), seed=12)
    logits = {}
    for backend in ("torch", "triton"):
        runner = gpu_llm(model_dir, dtype="bfloat16", attention_backend=backend,
                         enforce_eager=True).llm_engine.model_runner
        from minivllm.engine.scheduler import ScheduledBatch
        from minivllm.engine.sequence import Sequence
        batch = ScheduledBatch()
        for i, prompt in enumerate(prompts):
            seq = Sequence(str(i), 0, prompt, SamplingParams())
            seq.block_table = list(range(i * 16, i * 16 + -(-len(prompt) // 8)))
            batch.add(seq, len(prompt))
        inputs = runner.prepare_inputs(batch)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)[inputs.logits_indices]
            logits[backend] = runner.model.compute_logits(hidden).float()
    error = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    print("bf16 relative logits error triton vs torch:", float(error))
    assert error < 2e-2


def test_full_length_sequence_under_cuda_graphs(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    llm = gpu_llm(model_dir, max_model_len=64, max_num_seqs=3)
    prompts = [list(range(5, 15)), list(range(20, 23)), list(range(40, 70))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert len(prompt) + len(output.outputs[0].token_ids) == 64
        assert list(output.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 64 - len(prompt))[0]
