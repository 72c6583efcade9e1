"""The examples say what they need and refuse nonsense arguments with a one-line error naming
the option (exit status 2), before importing anything heavy: this runs with or without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "llama_paged_decode.py"
CONTEXT_PARALLEL = ROOT / "examples" / "context_parallel.py"


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("script", [LLAMA, CONTEXT_PARALLEL])
def test_each_example_says_what_it_needs_in_its_help(script):
    done = run(script, "--help")
    assert done.returncode == 0
    assert "Needs " in done.stdout


@pytest.mark.parametrize("args, named", [
    (["--layers", "0"], "--layers: expected a positive integer, got 0"),
    (["--heads", "7"], "--heads: expected a multiple of --kv-heads=2, got 7"),
    (["--kv-heads", "-1"], "--kv-heads: expected a positive integer"),
    (["--prompt-lens", "5,0", "--max-new-tokens", "3,3"], "--prompt-lens: expected positive"),
    (["--max-new-tokens", "3"], "--max-new-tokens: expected one count per prompt (6), got 1"),
    (["--max-new-tokens", "1,1,1,1,1,1"], "--max-new-tokens: expected counts >= 1 and at least "
                                          "one >= 2"),
    (["--warmup-passes", "-1"], "--warmup-passes: expected 0 or more"),
    (["--logit-tol", "0"], "--logit-tol: expected a positive tolerance"),
    (["--buckets", "0,4"], "--buckets: expected positive batch sizes"),
    (["--plan-on-device"], "--plan-on-device: needs --graphs and the splitkv backend"),
    (["--dtype", "float32"], "--dtype: the splitkv backend takes bfloat16 or float16"),
])
def test_the_llama_example_refuses_nonsense_arguments(args, named):
    done = run(LLAMA, *args)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    assert "Traceback" not in done.stderr


def test_the_llama_example_says_in_one_line_what_is_missing():
    """No torch: one line naming the install; no CUDA device: one line naming the CPU run."""
    done = run(LLAMA)
    if done.returncode == 0:
        pytest.skip("this machine runs the example (torch, transformers and a GPU)")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "needs PyTorch and transformers" in lines[0] or "--backend reference" in lines[0]


def test_the_context_parallel_example_refuses_a_negative_length():
    done = run(CONTEXT_PARALLEL, "--lens", "-3")
    assert done.returncode == 2
    assert "--lens" in done.stderr and "Traceback" not in done.stderr
