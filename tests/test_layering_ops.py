"""Import layering of the model code: which packages may import which, read from every import
statement (lazy ones inside functions included), and a torch engine that never imports triton."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TinyModelFactory

PACKAGE = Path(__file__).resolve().parent.parent / "minivllm"


def imported_modules(path: Path, top_level_only: bool = False) -> set[str]:
    """The modules a file imports: "from a.b import c" counts as a.b and a.b.c (c may be a
    module); top_level_only: only the module body's own import statements."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(package: str, forbidden: list[str]) -> list[str]:
    """`file: module` for each import under minivllm/<package> of a forbidden package."""
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                found.append(f"{path.relative_to(PACKAGE)}: {name}")
    return found


@pytest.mark.parametrize("package,forbidden", [
    ("layers", ["minivllm.executor"]),
    ("models", ["minivllm.executor", "minivllm.kernels"]),
    ("kernels", ["minivllm.layers", "minivllm.models", "minivllm.executor", "minivllm.engine",
                 "minivllm.attention"]),
    ("attention", ["minivllm.layers", "minivllm.models", "minivllm.executor", "minivllm.engine"]),
    ("distributed", ["minivllm.layers", "minivllm.models", "minivllm.executor", "minivllm.engine"]),
])
def test_package_imports_nothing_from_above(package: str, forbidden: list[str]) -> None:
    assert violations(package, forbidden) == []


def test_cuda_graphs_do_not_import_models() -> None:
    assert not any(name.startswith("minivllm.models") for name in imported_modules(
        PACKAGE / "executor" / "cuda_graphs.py"))


def test_config_does_not_import_the_gguf_reader_up_front() -> None:
    assert "minivllm.gguf_loader" not in imported_modules(PACKAGE / "config.py", top_level_only=True)


def test_torch_engine_never_imports_triton(tiny_model_factory: TinyModelFactory) -> None:
    """kernels="torch" builds every op with torch: the Triton kernels (and triton itself) are
    imported only on the Triton path."""
    model_dir = tiny_model_factory("Qwen3MoeForCausalLM")
    script = f"""
import sys
from minivllm import LLM, SamplingParams
llm = LLM({model_dir!r}, kernels="torch", device="cpu", max_model_len=64)
llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(temperature=0.8, max_tokens=3), use_tqdm=False)
print(sorted(name for name in sys.modules if name == "triton" or name.startswith(("triton.", "minivllm.kernels"))))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
