"""The layout shows the layers: only ``splitkv/runtime/`` imports CuPy (cupy, cupyx,
cupy_backends), and the planner imports nothing from the runtime, so plans can be made and
inspected where there is no GPU. Read from the sources with ``ast``, so an import inside a
function counts as much as one at the top."""

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
    assert imports_from(["splitkv.runtime"], PACKAGE / "planner") == {}


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


def test_the_import_reader_sees_what_it_looks_for():
    """The two tests above cannot pass by reading nothing: the runtime's CuPy imports are seen,
    and every spelling of an import resolves to its absolute name."""
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
