"""``run()`` captured into a CUDA graph in each framework's default capture mode (global), as the
very first capture of a fresh process, with the plan made on the capture stream, on the
default stream or on a third stream: the replay gives the eager run's bits.

Each case runs in its own Python process: the bug this pins (a host wait on the plan's upload
event inside the capture, which the global mode forbids) showed only for the first wrapper of a
process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

TORCH_SCRIPT = r"""
import sys
import numpy as np
import torch
from splitkv import BatchDecodeWrapper
from splitkv.testing import scattered_page_table

plan_stream, strategy, pdl = sys.argv[1], sys.argv[2], sys.argv[3] == "pdl"
rng = np.random.default_rng(5)
pt, num_pages = scattered_page_table([3000, 700, 9], 16, rng)
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(3, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
k = torch.randn(num_pages, 16, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
v = torch.randn(num_pages, 16, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
torch.cuda.synchronize()
capture = torch.cuda.Stream()
other = torch.cuda.Stream()
w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", pdl=pdl)
where = {"capture": capture, "default": torch.cuda.current_stream(), "other": other}[plan_stream]
w.plan(pt, num_splits=4, strategy=strategy, stream=where)
eager = torch.full_like(q, float("nan"))
w.run(q, k, v, out=eager, stream=where)
out = torch.full_like(q, float("nan"))
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, stream=capture):            # global capture mode
    w.run(q, k, v, out=out, stream=torch.cuda.current_stream())
torch.cuda.current_stream().wait_stream(where)       # the replay follows plan()'s upload
graph.replay()
torch.cuda.synchronize()
assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), "replay != eager"
print("replay == eager")
"""

CUPY_SCRIPT = r"""
import sys
import cupy
import numpy as np
from splitkv import BatchDecodeWrapper
from splitkv.measure.test_data import random_device_array
from splitkv.testing import scattered_page_table

plan_stream, strategy = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(6)
pt, num_pages = scattered_page_table([5000, 60], 16, rng)
q = random_device_array((2, 16, 128), "float16", rng)
k = random_device_array((num_pages, 16, 4, 128), "float16", rng)
v = random_device_array((num_pages, 16, 4, 128), "float16", rng)
capture = cupy.cuda.Stream(non_blocking=True)
where = {"capture": capture, "default": cupy.cuda.Stream.null,
         "other": cupy.cuda.Stream(non_blocking=True)}[plan_stream]
w = BatchDecodeWrapper(16, 4, 128, 16, "float16")
w.plan(pt, num_splits=8, strategy=strategy, stream=where)
eager = cupy.full(q.shape, np.nan, dtype=q.dtype)
w.run(q, k, v, out=eager, stream=where)
where.synchronize()
out = cupy.full(q.shape, np.nan, dtype=q.dtype)
capture.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
w.run(q, k, v, out=out, stream=capture)
graph = capture.end_capture()
graph.launch(capture)
capture.synchronize()
assert (out.view(cupy.uint16) == eager.view(cupy.uint16)).all(), "replay != eager"
print("replay == eager")
"""


def run_fresh(script: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "replay == eager" in proc.stdout, \
        f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("plan_stream", ["default", "capture", "other"])
@pytest.mark.parametrize("strategy,pdl", [("fused", "pdl"), ("split_merge", "pdl"),
                                          ("fused", "plain")])
def test_torch_graph_global_mode_first_capture_of_a_process(plan_stream, strategy, pdl):
    pytest.importorskip("torch")
    run_fresh(TORCH_SCRIPT, plan_stream, strategy, pdl)


@pytest.mark.parametrize("plan_stream", ["default", "capture", "other"])
@pytest.mark.parametrize("strategy", ["fused", "split_merge"])
def test_cupy_stream_capture_global_mode(plan_stream, strategy):
    pytest.importorskip("cupy")
    run_fresh(CUPY_SCRIPT, plan_stream, strategy)
