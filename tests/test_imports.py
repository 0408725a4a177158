"""The package's import surface: every exported name imports, README's Python runs, and the package's
own imports go one way (no cycle; the model imports nothing above it; `import cs336_systems` neither
imports the kernels, the benchmarks nor Triton, yet knows every attention backend)."""

import ast
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cs336_systems

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = Path(cs336_systems.__file__).parent
README = ROOT / "README.md"


def _packages() -> list[str]:
    """cs336_systems and every subpackage, found by walking the source tree."""
    found = [cs336_systems.__name__]
    found += [info.name for info in pkgutil.walk_packages(cs336_systems.__path__, "cs336_systems.") if info.ispkg]
    return found


@pytest.mark.parametrize("package", _packages())
def test_every_exported_name_imports(package):
    module = importlib.import_module(package)
    exported = getattr(module, "__all__", [])  # a package may export nothing (report/ is run, not imported from)
    assert len(set(exported)) == len(exported), f"{package}.__all__ repeats a name"
    for name in exported:  # as `from package import name` finds it: an attribute, or else a submodule
        if not hasattr(module, name):
            try:
                importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError:
                pytest.fail(f"{package}.__all__ names {name!r}, which is neither defined there nor a submodule")


# ------------------------------------------------------------------------------------------------
# README's Python
# ------------------------------------------------------------------------------------------------
def _readme_python_blocks() -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start()) + 1, match.group(1))
            for match in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


BLOCKS = _readme_python_blocks()


def _run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter from the repository root, as a reader would paste it."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_readme_has_python():
    assert BLOCKS, "README.md has no ```python block (the library-use example is expected)"


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_imports(line, code):
    """The block's import statements, run alone: on any machine, GPU or not."""
    imports = [ast.get_source_segment(code, node) for node in ast.parse(code).body
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    done = _run_python("\n".join(imports))
    assert done.returncode == 0, f"README.md:{line}: its imports fail:\n{done.stderr}"


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
    if ".cuda()" in code and not torch.cuda.is_available():
        pytest.skip(f"README.md:{line} calls .cuda() and this machine has no GPU (its imports are checked by "
                    "test_readme_block_imports)")
    done = _run_python(code)
    assert done.returncode == 0, f"README.md:{line} fails:\n{done.stderr}"


# ------------------------------------------------------------------------------------------------
# the package's import graph
# ------------------------------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imports(source: str, module: str, is_package: bool, known) -> set[str]:
    """The modules of `known` that `module` imports, at module level or inside functions (a function-level
    import runs the imported module's top level too). `from a import b` names a.b where b is a module,
    else a. Parent packages are left out: their __init__ running first is how every package works."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x` is package.x, each further dot one package up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found - {module}


GRAPH = {module: _imports(path.read_text(), module, path.name == "__init__.py", MODULES)
         for module, path in MODULES.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as [a, b, ..., a], or None (depth-first search keeping the current path)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        path = path + [node]
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                cycle = visit(nxt, path)
                if cycle:
                    return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start, [])
            if cycle:
                return cycle
    return None


def test_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_parser_sees_every_form_of_import():
    known = {"pkg", "pkg.a", "pkg.a.b", "pkg.a.c", "pkg.d"}
    source = """
import pkg.d
from pkg.a import b, CONSTANT
from . import c
from .. import d as renamed

def later():
    from pkg import a
"""
    assert _imports(source, "pkg.a.x", False, known) == {"pkg.d", "pkg.a.b", "pkg.a", "pkg.a.c"}
    assert _imports("from .b import f\nfrom . import c", "pkg.a", True, known) == {"pkg.a.b", "pkg.a.c"}
    # and in the package itself: its __init__ re-exports, optim's fused kernel imported inside a function
    assert "cs336_systems.model.transformer" in GRAPH["cs336_systems.model"]
    assert "cs336_systems.kernels.adamw_triton" in GRAPH["cs336_systems.optim"]


def test_package_imports_have_no_cycle():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_model_imports_nothing_above_it():
    """model/ is the ground floor: kernels, training utilities and benchmarks build on it, never the
    other way round (its attention registry names the backends above it by path instead)."""
    for module in MODULES:
        if module.startswith("cs336_systems.model"):
            above = {m for m in GRAPH[module] if not m.startswith("cs336_systems.model")}
            assert not above, f"{module} imports {sorted(above)}"


def test_kernels_import_only_the_model_and_themselves():
    for module in MODULES:
        if module.startswith("cs336_systems.kernels"):
            other = {m for m in GRAPH[module] if not m.startswith(("cs336_systems.kernels", "cs336_systems.model"))}
            assert not other, f"{module} imports {sorted(other)}"


def test_importing_the_package_knows_every_backend_and_loads_nothing_above_the_model():
    """In a fresh process: `import cs336_systems` imports neither Triton (bench/kernel_resources.py must
    set Triton up before it is imported) nor kernels/ or bench/, yet lists every attention backend, and
    each resolves to its function without having been registered by an import."""
    code = """
import sys
import cs336_systems
from cs336_systems.model import ATTENTION_BACKENDS, get_attention
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith(("cs336_systems.kernels", "cs336_systems.bench")))
assert not loaded, loaded
assert sorted(ATTENTION_BACKENDS) == ["flash_pytorch", "flash_triton", "naive", "naive_annotated", "sdpa"], ATTENTION_BACKENDS
from cs336_systems.bench.e2e import naive_annotated_attention
from cs336_systems.kernels import flash_attention_pytorch, flash_attention_triton
from cs336_systems.model.attention import naive_attention, sdpa_attention
expected = {"naive": naive_attention, "sdpa": sdpa_attention, "flash_pytorch": flash_attention_pytorch,
            "flash_triton": flash_attention_triton, "naive_annotated": naive_annotated_attention}
for name, fn in expected.items():
    assert get_attention(name) is fn, name
"""
    done = _run_python(code)
    assert done.returncode == 0, done.stderr


def test_unknown_or_malformed_backends_are_clear_errors():
    from cs336_systems.model.attention import ATTENTION_BACKENDS, get_attention, naive_attention, register_attention

    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; known: flash_pytorch, flash_triton"):
        get_attention("flash")
    with pytest.raises(ValueError, match=r"'cs336_systems\.kernels' is not 'module:function'"):
        register_attention("broken", "cs336_systems.kernels")
    assert "broken" not in ATTENTION_BACKENDS
    register_attention("by_path", "cs336_systems.model.attention:naive_attention")
    try:
        assert get_attention("by_path") is naive_attention
    finally:
        del ATTENTION_BACKENDS["by_path"]
