"""The README's examples run as written: its CPU example here, and on a GPU every Python
example in order, in one namespace (each continues the one before, as a reader would)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def needs_gpu(block: str) -> bool:
    return bool(re.search(r"\b(cupy|torch)\b", block))


def run_blocks(blocks) -> dict:
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    return namespace


def test_the_readme_has_a_cpu_example_and_gpu_examples():
    assert BLOCKS and not needs_gpu(BLOCKS[0])
    assert [b for b in BLOCKS if needs_gpu(b)]


def test_the_cpu_examples_run_as_written(capsys):
    cpu = [b for b in BLOCKS if not needs_gpu(b)]
    namespace = run_blocks(cpu)
    assert "Plan(strategy=" in capsys.readouterr().out     # it prints the planner's choice
    assert namespace["out"].shape == (2, 32, 128)


@pytest.mark.gpu
def test_the_gpu_examples_run_as_written():
    pytest.importorskip("torch", reason="the README's GPU examples use PyTorch too")
    namespace = run_blocks(BLOCKS)
    namespace["stream"].synchronize()
    assert namespace["graph_wrapper"].device_plan_state()["plans"] >= 4
