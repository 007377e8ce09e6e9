"""The seam between scheduling and execution, checked on the source (no imports run): the
scheduler's side knows nothing of how steps run, and the runner knows of the engine only
the SchedulerOutput it is handed (engine/scheduler_output.py)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minivllm"

# The scheduler's side: with everything it imports, directly or not.
SCHEDULING = ["minivllm.engine.scheduler", "minivllm.engine.kv_cache_manager", "minivllm.engine.sequence",
              "minivllm.engine.scheduler_output"]
EXECUTION = ["minivllm.executor", "minivllm.attention", "minivllm.kernels", "minivllm.models", "minivllm.layers"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its source (inside functions
    and TYPE_CHECKING blocks too): `from package import name` counts the submodule `name`
    where there is one, else the package."""
    path = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                         for alias in node.names)
    return {name for name in found if name in MODULES}


def within(module: str, packages: list[str]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_the_scheduling_side_imports_nothing_that_runs_steps() -> None:
    for start in SCHEDULING:
        reached, todo, via = {start}, [start], {start: start}
        while todo:
            module = todo.pop()
            for imported in imports(module) - reached:
                reached.add(imported)
                todo.append(imported)
                via[imported] = module
        for module in sorted(reached):
            assert not within(module, EXECUTION), f"{start} reaches {module} (imported by {via[module]})"


def test_the_executor_knows_the_engine_only_by_its_scheduler_output() -> None:
    executor = [module for module in MODULES if within(module, ["minivllm.executor"])]
    assert "minivllm.executor.model_runner" in executor
    for module in executor:
        engine = {name for name in imports(module) if within(name, ["minivllm.engine"])}
        assert engine <= {"minivllm.engine.scheduler_output"}, f"{module} imports {sorted(engine)}"
