"""The torch path needs no Triton: with `import triton` failing (as where it is not installed),
minivllm imports, builds an engine on CPU with the torch kernels, generates, and its command
line works; nor does it load xgrammar before a request asks for structured outputs. Each check
runs in a fresh interpreter, since this one has imported Triton."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per check

# Prepended to each child's code: `import triton` (and any triton.* submodule) fails as if the
# package were absent, and the child reports any Triton module that got loaded all the same.
_BLOCK_TRITON = textwrap.dedent("""
    import atexit
    import importlib.abc
    import sys

    class _NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTriton())
    atexit.register(lambda: print("TRITON MODULES:", sorted(m for m in sys.modules if m.split(".")[0] == "triton")))
""")


def _run_without_triton(code: str) -> str:
    """Run `code` in a child Python with Triton blocked; its stdout. Fails the test if the child
    fails or loaded a Triton module."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    result = subprocess.run([sys.executable, "-c", _BLOCK_TRITON + textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "TRITON MODULES: []" in result.stdout, result.stdout
    return result.stdout


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_llm_generates_without_triton(tiny_model_factory, architecture: str) -> None:
    model_dir = tiny_model_factory(architecture)
    out = _run_without_triton(f"""
        from minivllm import LLM, SamplingParams

        llm = LLM({model_dir!r}, device="cpu", kernels="torch", dtype="float32")
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        [output] = llm.generate(["Hello there"], params, use_tqdm=False)
        print("TOKENS:", len(output.outputs[0].token_ids))
        import sys
        print("XGRAMMAR LOADED:", "xgrammar" in sys.modules)
    """)
    assert "TOKENS: 4" in out
    assert "XGRAMMAR LOADED: False" in out  # loaded only for a request with structured outputs


def test_cli_without_triton(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    out = _run_without_triton(f"""
        from minivllm.entrypoints.cli import main

        for command in ("generate", "serve"):
            try:
                main([command, "--help"])
            except SystemExit as exit:
                assert exit.code == 0, exit.code
        import minivllm.entrypoints.openai.api_server  # what `serve` runs, past its --help
        main(["generate", "--model", {model_dir!r}, "--device", "cpu", "--prompt", "Hi", "--max-tokens", "3",
              "--ignore-eos"])
    """)
    assert "--device" in out and "(3 tokens, finish_reason=length)" in out
