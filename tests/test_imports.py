"""The package's import surface: every exported name imports, README's Python runs, and the package's
own imports go one way (no cycle; the model imports nothing above it, nor does its attention registry
name anything above the kernels, "module:function" paths included; bench/ imports nothing of report/;
analysis/ is a floor of pure models; `import cs336_systems` neither imports the kernels, the benchmarks
nor Triton, yet knows the model's and the kernels' attention backends)."""

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
    assert "cs336_systems.model.config" in GRAPH["cs336_systems.model"]
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
    set Triton up before it is imported) nor kernels/ or bench/, yet lists the model's and the kernels'
    backends, each resolving to its function; importing bench.e2e adds the one bench defines."""
    code = """
import sys
import cs336_systems
from cs336_systems.model import ATTENTION_BACKENDS, get_attention
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith(("cs336_systems.kernels", "cs336_systems.bench")))
assert not loaded, loaded
assert sorted(ATTENTION_BACKENDS) == ["flash_pytorch", "flash_triton", "naive", "sdpa", "sdpa_cudnn", "sdpa_flash"], ATTENTION_BACKENDS
from cs336_systems.kernels import flash_attention_pytorch, flash_attention_triton
from cs336_systems.model.attention import naive_attention, sdpa_attention
expected = {"naive": naive_attention, "sdpa": sdpa_attention, "flash_pytorch": flash_attention_pytorch,
            "flash_triton": flash_attention_triton}
for name, fn in expected.items():
    assert get_attention(name) is fn, name
from cs336_systems.bench.e2e import naive_annotated_attention
assert get_attention("naive_annotated") is naive_annotated_attention
"""
    done = _run_python(code)
    assert done.returncode == 0, done.stderr


def test_the_package_and_the_reports_entry_point_import_no_torch():
    """In a fresh process: `import cs336_systems`, the model's configurations and accounting, and the report's entry
    point (which every table and figure job of the pipeline starts) load without torch, which would add ~2 s to each
    of those jobs; asking for a name built on torch (`TransformerLM`) loads it then, and it is the model's class."""
    code = """
import sys
import cs336_systems
from cs336_systems.model import get_config, parameter_count, leaderboard_flops
import cs336_systems.report.__main__
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("cs336_systems"))
assert parameter_count(get_config("small")) > 0
from cs336_systems import TransformerLM
from cs336_systems.model.transformer import TransformerLM as defined
assert TransformerLM is defined and "torch" in sys.modules
try:
    cs336_systems.model.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e), e
else:
    raise AssertionError("an unknown name resolved")
"""
    done = _run_python(code)
    assert done.returncode == 0, done.stderr


def test_the_reports_entry_point_loads_matplotlib_only_to_draw():
    """In a fresh process the report's entry point (every table job's start) loads no matplotlib, which took about
    half of a table job's start-up; the figures' `pyplot()` loads it then, on the Agg backend (no display)."""
    code = """
import sys
import cs336_systems.report.__main__
assert "matplotlib" not in sys.modules, sorted(m for m in sys.modules if m.startswith("matplotlib"))
from cs336_systems.report.figures import pyplot
plt = pyplot()
import matplotlib
assert matplotlib.get_backend().lower() == "agg", matplotlib.get_backend()
assert plt is sys.modules["matplotlib.pyplot"]
"""
    done = _run_python(code)
    assert done.returncode == 0, done.stderr


# Where a registry entry of the model may point: the model itself and the kernels (the floors below
# bench, report, distributed and train, which register their own entries instead).
REGISTRY_FLOORS = ("cs336_systems.model", "cs336_systems.kernels")


def _entry_module(entry) -> str:
    """The module an attention registry entry names: a "module:function" path's module, or where the
    function (a functools.partial's function) is defined."""
    if isinstance(entry, str):
        return entry.partition(":")[0]
    return getattr(entry, "func", entry).__module__


def _registered_paths() -> list[tuple[str, str]]:
    """(module, path) of every `register_attention(name, "module:function")` call in the package's source."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    == "register_attention" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)):
                found.append((module, node.args[1].value))
    return found


def test_registry_entries_name_nothing_above_the_kernels():
    """The model's registry as `import cs336_systems.model` leaves it (fresh process): every entry, path or
    function, lives in the model or the kernels; and no source file registers a path above them (a
    higher layer registers its function itself, in the module that defines it)."""
    code = f"""
import cs336_systems.model
from cs336_systems.model import ATTENTION_BACKENDS
from tests.test_imports import _entry_module
bad = {{name: _entry_module(fn) for name, fn in ATTENTION_BACKENDS.items()
        if not _entry_module(fn).startswith({REGISTRY_FLOORS!r})}}
assert not bad, bad
"""
    done = _run_python(code)
    assert done.returncode == 0, done.stderr
    for module, path in _registered_paths():
        assert path.partition(":")[0].startswith(REGISTRY_FLOORS), f"{module} registers {path!r}, above the kernels"
    for module in ("cs336_systems.bench.e2e", "cs336_systems.bench.flash_bench", "cs336_systems.train"):
        importlib.import_module(module)  # whatever higher layers register, no path points up
    from cs336_systems.model import ATTENTION_BACKENDS

    paths = {name: fn for name, fn in ATTENTION_BACKENDS.items() if isinstance(fn, str)}
    assert paths and all(_entry_module(p).startswith(REGISTRY_FLOORS) for p in paths.values()), paths
    assert _entry_module("cs336_systems.bench.e2e:f") == "cs336_systems.bench.e2e"  # the check can fail


def test_bench_imports_nothing_from_the_report():
    """bench/ measures; report/ reads what it wrote: the models both use are in analysis/."""
    for module in MODULES:
        if module.startswith("cs336_systems.bench"):
            report = {m for m in GRAPH[module] if m.startswith("cs336_systems.report")}
            assert not report, f"{module} imports {sorted(report)}"


def _external_imports(source: str) -> set[str]:
    """Top-level names of the non-relative modules `source` imports (`torch.distributed`, `matplotlib.pyplot`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_analysis_is_a_floor_of_pure_models():
    """analysis/ imports neither bench/, report/, distributed/ nor train, nor torch.distributed nor a
    plotting library: formulas and fits that the benchmarks and the report both stand on."""
    above = ("cs336_systems.bench", "cs336_systems.report", "cs336_systems.distributed", "cs336_systems.train")
    modules = [m for m in MODULES if m.startswith("cs336_systems.analysis")]
    assert len(modules) > 3, modules
    for module in modules:
        up = {m for m in GRAPH[module] if m.startswith(above)}
        assert not up, f"{module} imports {sorted(up)}"
        external = {m for m in _external_imports(MODULES[module].read_text())
                    if m.startswith(("torch.distributed", "matplotlib"))}
        assert not external, f"{module} imports {sorted(external)}"


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


def _private_uses(source: str, module: str, known) -> list[str]:
    """Where `source` (module `module`) uses another of `known` modules' private names: `from X import _name`, or
    `alias._name` with alias bound to an imported module X (`import X as alias`, `from P import X`). Dunder names
    (`__version__`) are public."""
    aliases, found = {}, []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target in known:
                    aliases[alias.asname or alias.name] = target
                elif node.module in known and node.module != module and private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = ast.unparse(node.value)
            if aliases.get(base, module) != module:
                found.append(f"line {node.lineno}: {base}.{node.attr} ({aliases[base]})")
    return found


def test_private_use_finder_sees_both_forms():
    source = ("from cs336_systems.a import _hidden, shown\nfrom cs336_systems import b\nimport cs336_systems.c as c\n"
              "b._plans.clear()\nc.__version__\nc.ok\n")
    known = {"cs336_systems.a", "cs336_systems.b", "cs336_systems.c"}
    assert _private_uses(source, "cs336_systems.d", known) == [
        "line 1: from cs336_systems.a import _hidden", "line 4: b._plans (cs336_systems.b)"]
    assert _private_uses("from cs336_systems.a import _own\n", "cs336_systems.a", known) == []


def test_no_module_uses_another_modules_private_names():
    """A module's `_private` names are its own: no module under cs336_systems/ imports another's or reaches them
    through an imported module, so a rename inside one module cannot silently break another."""
    found = {module: uses for module, path in MODULES.items()
             if (uses := _private_uses(path.read_text(), module, MODULES))}
    assert not found, found
