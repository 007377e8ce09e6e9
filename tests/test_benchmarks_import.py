"""Every benchmark imports as a module from the repository root (how gpu_check.sh runs them)
and only runs when executed: a broken import shows up here, not on the GPU machine."""

import importlib
import pkgutil

import pytest

import benchmarks
import benchmarks.kernels

MODULES = [f"benchmarks.{m.name}" for m in pkgutil.iter_modules(benchmarks.__path__) if not m.ispkg] + [
    f"benchmarks.kernels.{m.name}" for m in pkgutil.iter_modules(benchmarks.kernels.__path__)]


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports_without_running(name: str) -> None:
    module = importlib.import_module(name)
    if name not in ("benchmarks.common", "benchmarks.presets", "benchmarks.schemas"):  # shared helpers
        assert callable(getattr(module, "main", None)), f"{name} has no main()"
