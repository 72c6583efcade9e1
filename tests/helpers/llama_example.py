"""``examples/llama_paged_decode.py`` as a module, for the tests that run it (``examples/`` is
not a package). Importing it imports torch: call this after ``pytest.importorskip("torch")``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_paged_decode.py"


def load_example():
    name = "llama_paged_decode"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules[name]
