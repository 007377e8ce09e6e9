"""Compile the engine's Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

Triton's interpreter (the CPU tests) runs kernels as Python, so it misses what only the
compiler sees: a name set inside a runtime `if` and used after it, an unsupported op, an
inline-asm constraint, register spills. This script calls the host wrappers with CPU
tensors of Qwen3-0.6B's shapes, catches each launch instead of running it (the arguments,
constexprs and options it would compile with, PDL on as on a Hopper GPU), and compiles it
with Triton's own compiler and ptxas for sm_90. Prints one line per launch: the kernel, its
registers and stack bytes (a stack means spills). Exit status 1 if any launch fails to compile.

    python -m tests.kernel_compile_check
    python -m tests.kernel_compile_check --sass decode   # + SASS opcode counts of launches matching "decode",
                                                         #   whole and per loop body

Runs without TRITON_INTERPRET (under it, kernels are not compiled at all).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET=1: it skips compilation"

import torch  # noqa: E402 (after the TRITON_INTERPRET check)
import triton  # noqa: E402 (after the TRITON_INTERPRET check)
from triton.backends.compiler import GPUTarget  # noqa: E402 (after the TRITON_INTERPRET check)
from triton.compiler import ASTSource, CompiledKernel, make_backend  # noqa: E402 (after the TRITON_INTERPRET check)
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402 (after the TRITON_INTERPRET check)
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402 (after the TRITON_INTERPRET check)

TARGET = GPUTarget("cuda", 90, 32)

Launch = tuple[str, JITFunction, tuple, dict[str, Any]]


def capture_launches(calls: dict[str, Callable[[], Any]]) -> list[Launch]:
    """Run each host call with kernel launches caught, not run: (label, kernel, args, kwargs)."""
    launches: list[Launch] = []
    label = ""

    def caught(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append((label, self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = caught
    try:
        for call in calls.values():
            call()
    finally:
        JITFunction.run = original
    return launches


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict[str, Any]) -> CompiledKernel:
    """Compile one caught launch for sm_90 as JITFunction.run would on the GPU (the same
    specialisation: types, constexprs, 16-byte alignment and divisibility of the arguments;
    Triton 3.6's own helpers); its .asm holds the assembly (ptx, cubin, ...), its .metadata
    the launch's dynamic shared memory."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = kwargs | {"debug": bool(kernel.debug)}
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    return triton.compile(source(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def _run_tool(name: str, args: list[str], cubin: bytes) -> str:
    """stdout of one of Triton's copies of the CUDA binary tools, run on a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> str:
    """cuobjdump's resource line (REG, STACK, ...) for a cubin."""
    out = _run_tool("cuobjdump", ["--dump-resource-usage"], cubin)
    lines = [line.strip() for line in out.splitlines() if "REG:" in line]
    return " ".join(lines[0].split()[:3]) if lines else "(no resource line)"


_SASS_LINE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")


def sass_opcodes(sass: str) -> collections.Counter[str]:
    """How often each SASS opcode (with its modifiers, e.g. LDS.U8) occurs in a cubin's code
    (nvdisasm's text): where a kernel spends instructions (byte-wise shared loads,
    conversions, address math)."""
    return collections.Counter(m.group(1) for line in sass.splitlines() if (m := _SASS_LINE.match(line)))


def sass_loops(sass: str) -> list[collections.Counter[str]]:
    """The opcodes of each loop body (a label up to a branch back to it) in nvdisasm's text,
    in code order: a kernel's per-tile cost, which the whole-kernel counts mix with its
    prologue and epilogue."""
    labels: dict[str, int] = {}
    opcodes: list[str] = []
    loops = []
    for line in sass.splitlines():
        if m := _SASS_LABEL.match(line):
            labels[m.group(1)] = len(opcodes)
        elif m := _SASS_LINE.match(line):
            opcodes.append(m.group(1))
            target = re.search(r"\((\.L_x_\d+)\)", m.group(2))
            start = labels.get(target.group(1), -1) if m.group(1) == "BRA" and target else -1
            if 0 <= start < len(opcodes) - 1:  # a branch back (not the code's closing self-branch)
                loops.append(collections.Counter(opcodes[start:]))
    return loops


def engine_calls() -> dict[str, Callable[[], Any]]:
    """The host calls of a Qwen3-0.6B step (bf16; a bf16 and an FP8 KV cache), with PDL on, and
    of Qwen3-30B-A3B's experts."""
    from minivllm.kernels import (
        batch_matmul,
        cascade_attention,
        decode_attention,
        fp8_matmul,
        fused_moe,
        fused_ops,
        mixed_attention,
        pdl,
        sampling,
        skinny_matmul,
    )
    from minivllm.kernels.split_k import SplitKPartials
    from minivllm.layers import fp8_linear

    pdl.pdl_enabled = lambda device: True  # as on a Hopper GPU
    skinny_matmul.sm_count = lambda device: 132  # an H100/H200's: split-K where the GPU would split
    batch_matmul.sm_count = lambda device: 132
    bf16, hq, hkv, d, block_size, hidden, inter = torch.bfloat16, 16, 8, 128, 16, 1024, 3072
    num_blocks, num_seqs = 64, 4
    seq_lens = torch.tensor([40, 300, 17, 129], dtype=torch.int32)
    block_tables = torch.arange(num_seqs * 20, dtype=torch.int32).reshape(num_seqs, 20) % num_blocks
    qsl = torch.tensor([0, 1, 2, 20, 45], dtype=torch.int32)
    positions = torch.arange(45)
    cos_sin = torch.zeros(4096, 2, d)
    calls: dict[str, Callable[[], Any]] = {}
    decode_tile_batches = (decode_attention.DECODE_SHORT_TILE_MIN_SEQS,)
    for cache_name, cache_dtype in (("bf16 cache", bf16), ("fp8 cache", torch.float8_e4m3fn)):
        k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        q = torch.zeros(45, hq, d, dtype=bf16)
        qkv = torch.zeros(45, (hq + 2 * hkv) * d, dtype=bf16)
        q_view, k_view, v_view = (t.view(45, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        norm_w = torch.ones(d, dtype=bf16)
        calls[f"qk_norm_rope_store, {cache_name}"] = lambda q_view=q_view, k_view=k_view, v_view=v_view, \
            k_cache=k_cache, v_cache=v_cache, norm_w=norm_w: fused_ops.qk_norm_rope_store(
                positions, q_view, k_view, v_view, cos_sin, k_cache, v_cache, positions, norm_w, norm_w, 1e-6)
        calls[f"mixed attention, {cache_name}"] = lambda q=q, k_cache=k_cache, v_cache=v_cache: \
            mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.088,
                                                  first_seq=2, first_token=2)
        calls[f"mixed attention, short prompts, {cache_name}"] = lambda q=q, k_cache=k_cache, v_cache=v_cache: \
            mixed_attention.paged_attention_mixed(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.088,
                                                  first_seq=2, first_token=2, max_query_len=40)
        decode_q = torch.zeros(num_seqs, hq, d, dtype=bf16)
        for splits in (1, 4):
            calls[f"decode, {splits} splits, {cache_name}"] = lambda decode_q=decode_q, k_cache=k_cache, \
                v_cache=v_cache, splits=splits: decode_attention.paged_attention_decode(
                    decode_q, k_cache, v_cache, seq_lens, block_tables, 0.088, splits)
        # decode_config's tiles for bigger batches (each distinct one once), on this batch's launch.
        big_batch_configs = {str(config): (batch, config) for batch in decode_tile_batches
                             if (config := decode_attention.decode_config(d, bf16, cache_dtype, batch))
                             != decode_attention.decode_config(d, bf16, cache_dtype, num_seqs)}
        for batch, config in big_batch_configs.values():
            calls[f"decode, tiles for {batch} sequences, {cache_name}"] = lambda decode_q=decode_q, \
                k_cache=k_cache, v_cache=v_cache, config=config: decode_attention.paged_attention_decode(
                    decode_q, k_cache, v_cache, seq_lens, block_tables, 0.088, 1, config=config)
        calls[f"cascade decode, {cache_name}"] = lambda decode_q=decode_q, k_cache=k_cache, v_cache=v_cache: \
            cascade_attention.paged_attention_decode_shared_prefix(
                decode_q, k_cache, v_cache, seq_lens, block_tables, torch.ones(1, dtype=torch.int32), 0.088,
                prefix_splits=2, suffix_splits=2)
    x = torch.zeros(4, hidden, dtype=bf16)
    w_hidden = torch.ones(hidden, dtype=bf16)
    calls["rms_norm"] = lambda: fused_ops.rms_norm(x, w_hidden, 1e-6)
    calls["add_rms_norm"] = lambda: fused_ops.add_rms_norm(x, x.clone(), w_hidden, 1e-6)
    calls["add_rms_norm of split-K partials"] = lambda: fused_ops.add_rms_norm(
        SplitKPartials(torch.zeros(4, skinny_matmul.MAX_ROWS, hidden), 1, bf16), x[:1].clone(), w_hidden, 1e-6)
    calls["silu_and_mul"] = lambda: fused_ops.silu_and_mul(torch.zeros(4, 2 * inter, dtype=bf16))
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)):  # qkv, o, gate_up, down
        calls[f"skinny_matmul {n}x{k}"] = lambda n=n, k=k: skinny_matmul.skinny_matmul(
            torch.zeros(1, k, dtype=bf16), torch.zeros(n, k, dtype=bf16))
    calls["skinny_matmul_silu_and_mul 6144x1024 (gate_up)"] = lambda: skinny_matmul.skinny_matmul_silu_and_mul(
        torch.zeros(1, hidden, dtype=bf16), torch.zeros(2 * inter, hidden, dtype=bf16))
    calls["skinny_matmul_partials 1024x2048 (o)"] = lambda: skinny_matmul.skinny_matmul_partials(
        torch.zeros(1, 2048, dtype=bf16), torch.zeros(1024, 2048, dtype=bf16))
    for n, k in ((4096, 1024), (1024, 2048)):  # qkv; o, whose partials the add-RMSNorm sums
        calls[f"batch_matmul {n}x{k}"] = lambda n=n, k=k: batch_matmul.batch_matmul(
            torch.zeros(batch_matmul.MAX_ROWS, k, dtype=bf16), torch.zeros(n, k, dtype=bf16), partial_sums=n == 1024)
    calls["batch_matmul 1024x2048 (o), 192 rows"] = lambda: batch_matmul.batch_matmul(
        torch.zeros(batch_matmul.PARTIAL_SUMS_MAX_ROWS, 2048, dtype=bf16), torch.zeros(1024, 2048, dtype=bf16),
        partial_sums=True)
    calls["batch_matmul_silu_and_mul 6144x1024 (gate_up)"] = lambda: batch_matmul.batch_matmul_silu_and_mul(
        torch.zeros(batch_matmul.MAX_ROWS, hidden, dtype=bf16), torch.zeros(2 * inter, hidden, dtype=bf16))
    experts, top_k, moe_inter = 16, 4, 768  # Qwen3-30B-A3B's expert shapes (fewer experts)
    calls["fused_moe (Qwen3-30B-A3B experts)"] = lambda: fused_moe.fused_moe(
        torch.zeros(4, 2048, dtype=bf16), torch.zeros(experts, 2 * moe_inter, 2048, dtype=bf16),
        torch.zeros(experts, 2048, moe_inter, dtype=bf16), torch.ones(4, top_k),
        torch.zeros(4, top_k, dtype=torch.int32))
    fp8 = torch.float8_e4m3fn
    for label, block in (("128x128 blocks", (128, 128)), ("per channel", None)):
        w13_scale, w2_scale = ((torch.ones(experts, 12, 16), torch.ones(experts, 16, 6)) if block
                               else (torch.ones(experts, 2 * moe_inter), torch.ones(experts, 2048)))
        # The scheme's quantised inputs, or weights only; a decode batch's tiles, and a prefill's.
        for activations, tokens in (("fp8", 4), ("bf16", 4), ("fp8", 8192)):
            quantize = None if activations == "bf16" else (lambda x, _, block=block: fp8_linear.quantize_activations(
                x, None if block is None else block[1], None))
            calls[f"fused_moe FP8 experts, {label}, {activations} activations, {tokens} tokens"] = (
                lambda quantize=quantize, scales=(w13_scale, w2_scale), block=block, tokens=tokens: fused_moe.fused_moe(
                    torch.zeros(tokens, 2048, dtype=bf16), torch.zeros(experts, 2 * moe_inter, 2048, dtype=fp8),
                    torch.zeros(experts, 2048, moe_inter, dtype=fp8), torch.ones(tokens, top_k),
                    torch.zeros(tokens, top_k, dtype=torch.int32), fp8=fused_moe.Fp8Experts(*scales, block, quantize)))
    for rows in (4, 64, 512):  # each of fp8_matmul's tiles
        calls[f"fp8_block_matmul 4096x1024 (qkv), {rows} rows"] = lambda rows=rows: fp8_matmul.fp8_block_matmul(
            torch.zeros(rows, 1024, dtype=fp8), torch.zeros(4096, 1024, dtype=fp8), torch.ones(32, 8), (128, 128),
            torch.ones(rows, 8), bf16)
    calls["gumbel_max_sample"] = lambda: sampling.gumbel_max_sample(
        torch.zeros(4, 151936, dtype=bf16), torch.zeros(4, dtype=torch.int64), torch.ones(4))
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", metavar="TEXT", help="print SASS opcode counts of the launches whose label "
                        "contains TEXT")
    sass_filter = parser.parse_args().sass
    failures = 0
    for label, kernel, args, kwargs in capture_launches(engine_calls()):
        try:
            compiled = compile_launch(kernel, args, kwargs)
            cubin = compiled.asm["cubin"]
            # cuobjdump's SHARED is the static part; Triton's buffers (pipelined loads, layout
            # conversions) are dynamic, and with registers they set how many programs fit an SM.
            print(f"ok    {label}: {kernel.fn.__name__} {resource_usage(cubin)} "
                  f"DYNAMIC_SHARED:{compiled.metadata.shared}")
            if sass_filter is not None and sass_filter in label:
                sass = _run_tool("nvdisasm", ["-c"], cubin)
                counts = sass_opcodes(sass)
                print(f"      {sum(counts.values())} instructions:",
                      ", ".join(f"{op} {n}" for op, n in counts.most_common(30)))
                for loop in sass_loops(sass):
                    print(f"      loop of {sum(loop.values())}:",
                          ", ".join(f"{op} {n}" for op, n in loop.most_common(12)))
        except Exception as error:  # noqa: BLE001 (every failure is reported, then counted)
            failures += 1
            print(f"FAIL  {label}: {kernel.fn.__name__}: {type(error).__name__}: {str(error)[:2000]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
