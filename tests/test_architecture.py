"""The package's import graph: every module imports, no two modules import each other (however indirectly),
no module imports another's private names, and the scheduler runs without torch.

`lint-imports` (make lint; contracts in pyproject.toml) holds the engine's packages to their layers
(docs/design.md); these checks cover the whole package, tests and benchmarks, including the modules that only
run on a GPU (CUDA graphs, the Triton kernels), which no other test here imports on a CPU.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "qwen3tts_agent"


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


IMPORT_EVERY_MODULE = """
import importlib, pkgutil, benchmarks, qwen3tts_agent
failed = []
for package in (qwen3tts_agent, benchmarks):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(module.name)
        except Exception as exc:
            failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
"""


def test_every_module_of_the_package_and_every_benchmark_imports() -> None:
    assert _run(IMPORT_EVERY_MODULE).strip() == ""


def test_the_scheduler_and_the_shared_types_import_no_torch() -> None:
    loaded = _run(
        "import sys, qwen3tts_agent.engine.scheduler, qwen3tts_agent.engine.messages\n"
        "print(sorted(m for m in ('torch', 'transformers', 'qwen_tts') if m in sys.modules))"
    )
    assert loaded.strip() == "[]"


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module), Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in imports.get(module, ()):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_of_the_package_is_in_an_import_cycle() -> None:
    """Every import counts (at the top, in a function, under TYPE_CHECKING), and so does what Python does on
    `import a.b.c`: it runs a.b's __init__ first, so an import of a package's module is one of the package."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    imports = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    for module, imported in list(imports.items()):
        for target in list(imported):
            parts = target.split(".")
            for n in range(1, len(parts)):
                package = ".".join(parts[:n])
                if package in imports and not (module + ".").startswith(package + "."):
                    imported.add(package)  # not the importer's own packages: those are already running
    assert _cycles(imports) == []


def test_the_cycle_check_finds_a_cycle_through_a_package_init() -> None:
    imports = {"p": {"p.a"}, "p.a": {"q.b"}, "q.b": {"p"}, "q": set(), "r": {"p.a"}}
    assert _cycles(imports) == [["p", "p.a", "q.b"]]


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == PACKAGE):
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    files = [p for folder in (PACKAGE, "tests", "benchmarks", "examples") for p in (ROOT / folder).rglob("*.py")
             if "results" not in p.relative_to(ROOT).parts]
    assert files
    assert [hit for path in files for hit in _private_imports(path)] == []
