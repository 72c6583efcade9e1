"""The layout shows the layers: only ``splitkv/runtime/`` imports CuPy (cupy, cupyx,
cupy_backends), and the planner imports nothing from the runtime or the measuring code, so
plans can be made and inspected where there is no GPU; imports flow one way, core <- planner <-
runtime <- measure <- bench <- calibration <- cli, with no circle between packages or between
the modules of a layer. Read from the sources with ``ast``, so an import inside a function
counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import splitkv

PACKAGE = Path(splitkv.__file__).parent
CUPY = ("cupy", "cupyx", "cupy_backends")


def package_of(path: Path) -> str:
    """The package a file's relative imports start from: splitkv/a/b.py and splitkv/a/__init__.py
    give splitkv.a."""
    return ".".join(path.relative_to(PACKAGE.parent).parent.parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of the modules ``source`` imports (``from a import b`` gives ``a`` and
    ``a.b``), relative imports resolved against ``package``, ``import_module("x")`` included."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in
              ("import_module", "__import__")):
            names.add(str(node.args[0].value))
    return names


def imports_of(folder: Path, exclude: Path | None = None) -> dict[str, set[str]]:
    return {str(path.relative_to(PACKAGE.parent)): imported_modules(path.read_text(), package_of(path))
            for path in sorted(folder.rglob("*.py"))
            if exclude is None or exclude not in path.parents}


def is_within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def imports_from(packages, folder: Path, exclude: Path | None = None) -> dict[str, list[str]]:
    """{file: its imports from ``packages``} for the files under ``folder`` that have any."""
    found = {path: sorted(n for n in names if is_within(n, packages))
             for path, names in imports_of(folder, exclude).items()}
    return {path: names for path, names in found.items() if names}


def test_only_the_runtime_imports_cupy():
    assert imports_from(CUPY, PACKAGE, exclude=PACKAGE / "runtime") == {}


def test_the_planner_imports_nothing_from_the_runtime():
    assert imports_from(["splitkv.runtime", "splitkv.measure"], PACKAGE / "planner") == {}


def test_the_core_imports_only_the_core():
    """Imports flow one way: the planner, the runtime and the tools build on ``splitkv.core``,
    which needs nothing else of splitkv."""
    others = [f"splitkv.{p.stem if p.is_file() else p.name}" for p in PACKAGE.iterdir()
              if p.name not in ("core", "__pycache__", "__init__.py") and not p.name.startswith(".")]
    assert imports_from(others, PACKAGE / "core") == {}
    assert imports_from(["splitkv.runtime"], PACKAGE / "core") == {}


def test_only_entry_points_import_the_cli():
    """The CLI is a layer over the library: outside ``splitkv/cli/`` only the ``__main__``
    modules (``python -m splitkv``, ``python -m splitkv.bench``) import it."""
    found = imports_from(["splitkv.cli"], PACKAGE, exclude=PACKAGE / "cli")
    assert sorted(found) == ["splitkv/__main__.py", "splitkv/bench/__main__.py"]


# ---------------------------------------------------------------- the graph of imports

# The layers from the bottom up: each imports only those below it (and core, _log, _version,
# testing, the modules every layer may use).
LAYERS = ("splitkv.core", "splitkv.planner", "splitkv.runtime", "splitkv.measure",
          "splitkv.bench", "splitkv.calibration", "splitkv.cli")
# Cycles between the modules of one layer that are the design, each with its reason: a
# ``BatchDecodeWrapper(use_cuda_graph=True)`` constructs its subclass, which is defined in a
# module of its own.
ALLOWED_MODULE_CYCLES = ({"splitkv.runtime.wrapper", "splitkv.runtime.graph_stable"},)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def absolute_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, relative imports resolved against ``package``."""
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return base


def imports_in(source: str, package: str, modules) -> set[str]:
    """The modules of ``modules`` that ``source`` imports, wherever the import is (a function's
    too): ``from a import b`` is module ``a.b`` where that is one, else ``a`` (b is a name in
    it); ``import_module("x")`` included. The parent packages that Python runs first are not
    counted: every module would depend on ``splitkv/__init__.py``."""
    def module_of(name: str) -> str:         # the longest prefix of ``name`` that is a module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_module(node, package)
            names = [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in
              ("import_module", "__import__")):
            names = [str(node.args[0].value)]
        else:
            continue
        found.update(name for name in map(module_of, names) if name)
    return found


def module_graph(modules=MODULES) -> dict[str, set[str]]:
    """{module: the modules of splitkv it imports}; the ``__main__`` entry points left out
    (nothing imports them)."""
    return {name: {m for m in imports_in(path.read_text(), package_of(path), modules)
                   if m != name and not m.endswith(".__main__")}
            for name, path in modules.items() if not name.endswith(".__main__")}


def package_of_module(name: str) -> str:
    """The layer a module belongs to: ``splitkv.runtime.wrapper`` -> ``splitkv.runtime``; a
    module at the top (``splitkv.testing``, ``splitkv/__init__.py``) is its own."""
    parts = name.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return name


def package_graph(graph) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name, imported in graph.items():
        here = package_of_module(name)
        found.setdefault(here, set()).update(p for p in map(package_of_module, imported)
                                             if p != here)
    return found


def cycles(graph) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_packages():
    """The packages import one another one way only: a circle would mean a layer reaches up
    (as the runtime once did, through the first-use probes, to the timing routine above it)."""
    assert cycles(package_graph(module_graph())) == []


def test_no_import_circle_between_the_modules_of_a_layer():
    """Within a layer too, modules import one another one way (``planner.profile_lookup`` sits
    above ``profiles`` and ``first_use``, which both build on ``profiles``)."""
    graph, found = module_graph(), {}
    for layer in ("splitkv.planner", "splitkv.runtime", "splitkv.measure", "splitkv.bench",
                  "splitkv.calibration"):
        inside = {name: {m for m in imported if is_within(m, [layer])}
                  for name, imported in graph.items() if is_within(name, [layer])}
        circles = [sorted(c) for c in cycles(inside) if c not in ALLOWED_MODULE_CYCLES]
        if circles:
            found[layer] = circles
    assert found == {}


def test_each_layer_imports_only_the_layers_below_it():
    packages = package_graph(module_graph())
    for i, layer in enumerate(LAYERS):
        above = set(LAYERS[i + 1:])
        assert sorted(packages.get(layer, set()) & above) == [], layer


def test_the_runtime_reaches_no_code_above_it():
    """The runtime imports nothing above it, not even inside a function: it finds the
    first-use probes through ``splitkv._first_use_source``, which ``splitkv/__init__.py``
    fills; outside the measuring code and the layers above it, only that installer imports
    ``splitkv.measure``."""
    packages = package_graph(module_graph())
    below = {"splitkv.core", "splitkv.planner", "splitkv._log", "splitkv._version",
             "splitkv._first_use_source"}
    assert packages["splitkv.runtime"] <= below
    assert packages["splitkv._first_use_source"] == set()
    importers = sorted(name for name, imported in module_graph().items()
                       if any(is_within(m, ["splitkv.measure"]) for m in imported)
                       and not is_within(name, ["splitkv.measure", *LAYERS[4:]]))
    assert importers == ["splitkv"]          # the hook's installer, at the top


def test_the_first_use_probes_are_installed_for_the_runtime():
    import splitkv
    from splitkv import _first_use_source

    assert _first_use_source._factory is splitkv._device_probes
    assert "splitkv.measure.first_use_probes" in module_graph()["splitkv"]


def test_the_graph_reader_resolves_and_finds_circles():
    modules = {"splitkv", "splitkv.runtime", "splitkv.runtime.wrapper", "splitkv.measure",
               "splitkv.measure.timing", "splitkv._log"}
    source = ("from .. import _log\nfrom ..measure import timing\nfrom . import wrapper\n"
              "def f():\n    from ..measure.timing import time_plan_us\n")
    assert imports_in(source, "splitkv.runtime", modules) == {
        "splitkv._log", "splitkv.measure.timing", "splitkv.runtime.wrapper"}
    source += "from . import device_info\nimport splitkv.measure\n"
    assert imports_in(source, "splitkv.runtime", modules) == {
        "splitkv._log", "splitkv.measure.timing", "splitkv.runtime.wrapper", "splitkv.runtime",
        "splitkv.measure"}
    assert package_of_module("splitkv.runtime.wrapper") == "splitkv.runtime"
    assert package_of_module("splitkv.testing") == "splitkv.testing"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_what_it_looks_for():
    """The CuPy and planner tests cannot pass by reading nothing: the runtime's CuPy imports
    are seen, and every spelling of an import resolves to its absolute name."""
    runtime = imports_of(PACKAGE / "runtime")
    assert any(is_within(n, CUPY) for names in runtime.values() for n in names)
    source = ("from .. import runtime\nfrom ..runtime.arrays import x\nimport cupy.cuda\n"
              "def f():\n    from cupy_backends.cuda.libs import nvrtc\n"
              "    importlib.import_module('cupy')\n")
    names = imported_modules(source, "splitkv.planner")
    assert {"splitkv.runtime", "splitkv.runtime.arrays", "cupy.cuda", "cupy_backends.cuda.libs",
            "cupy"} <= names
    assert is_within("splitkv.runtime", ["splitkv.runtime"]) and not is_within("cupyish", CUPY)


def test_every_public_name_imports_from_splitkv_without_a_gpu():
    """What the README and docs/api.md use, as ``from splitkv import ...``: the planner's names
    too (imported on first use, so ``import splitkv`` stays light)."""
    import splitkv
    from splitkv import choose_plan, load_profile, rank_candidates  # noqa: F401
    from splitkv.planner import choose_plan as planner_choose_plan

    assert choose_plan is planner_choose_plan
    for name in splitkv.__all__:
        assert getattr(splitkv, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'choose_plans'"):
        splitkv.choose_plans


ENGINES = ("torch", "transformers")


def top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported (module-level statements only, not
    those inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def test_only_the_integrations_import_an_engine_when_imported():
    """torch and transformers are optional: outside ``splitkv/integrations/`` they are imported
    inside functions only (a tool that uses them when asked), so ``import splitkv`` and every
    layer import without them."""
    found = {str(path.relative_to(PACKAGE.parent)): sorted(n for n in top_level_imports(path)
                                                           if is_within(n, ENGINES))
             for path in sorted(PACKAGE.rglob("*.py"))
             if PACKAGE / "integrations" not in path.parents}
    assert {path: names for path, names in found.items() if names} == {}


def test_only_the_integrations_import_transformers():
    assert imports_from(["transformers"], PACKAGE, exclude=PACKAGE / "integrations") == {}


def test_nothing_imports_the_integrations():
    """The integrations sit on top: no layer of splitkv imports them (only their users do)."""
    assert imports_from(["splitkv.integrations"], PACKAGE,
                        exclude=PACKAGE / "integrations") == {}


def test_the_integrations_use_the_public_api():
    """They reach the GPU through ``splitkv``'s public names (``BatchDecodeWrapper``,
    ``reference_decode``), never the runtime's modules or CuPy, so the runtime can change
    beneath them."""
    found = imports_from(["splitkv.runtime", "splitkv.planner", *CUPY], PACKAGE / "integrations")
    assert found == {}


def test_import_splitkv_imports_no_engine():
    import subprocess
    import sys

    code = ("import sys, splitkv, splitkv.core; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, check=True).stdout.strip()
    assert out == "[]"


MAX_MODULE_LINES = 600


def test_every_module_is_at_most_600_lines():
    """A module past this is split by job (as planner/features.py and cost_model.py are)."""
    lengths = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
               for path in PACKAGE.rglob("*.py")}
    assert len(lengths) > 50
    assert {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}
