"""After ``splitkv precompile`` a fresh process compiles nothing: the command writes the CUBINs
of one configuration (for this GPU's architecture, the default) into an empty
``$SPLITKV_CACHE_DIR``; then a new interpreter with that cache and an empty CuPy cache makes
the wrapper, warms it up, plans and runs batches of every kind its plans meet (matching the
float64 reference), and loads every module from the precompiled files. Counted twice: by
``modules.module_origins()``, and by ``cupy.RawModule`` itself, wrapped to record every module
made from source, whoever asked for it (the planning kernel of a graph-stable wrapper too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

ROOT = str(Path(__file__).resolve().parents[2])

# Run in the fresh interpreter: argv[1] is "per_shape" or "graph_stable", argv[2] the K/V
# dtype ("" for 16-bit). Prints one JSON line: warmup()'s count, module_origins(), and the
# first characters of each module compiled from source.
SERVE = r'''
import json
import sys

import cupy
import numpy as np

built = []
_raw_module = cupy.RawModule


def counting_raw_module(*args, **kwargs):
    if kwargs.get("code") is not None:
        built.append(kwargs["code"][:80])
    return _raw_module(*args, **kwargs)


cupy.RawModule = counting_raw_module

from splitkv import BatchDecodeWrapper, PageTable, reference_decode  # noqa: E402
from splitkv.core.reference import to_float64  # noqa: E402
from splitkv.measure.test_data import (assert_matches_reference, plan_and_run,  # noqa: E402
                                       random_device_array, random_kv_caches,
                                       scattered_page_table)
from splitkv.runtime import modules  # noqa: E402

mode, kv = sys.argv[1], sys.argv[2] or None
rng = np.random.default_rng(0)
if mode == "per_shape":
    wrapper = BatchDecodeWrapper(32, 8, 128, 16, "float16", kv_dtype=kv)
    count = wrapper.warmup(logits_soft_cap=True)
    # lone CTAs of long chunks, grids past the SMs, short and ragged batches, cap on and off
    for step, (batch, longest) in enumerate([(1, 40000), (4, 9000), (64, 300), (128, 64),
                                             (8, 2048), (2, 20000)]):
        lens = rng.integers(1, longest, batch)
        table, pages = scattered_page_table(lens, 16, rng)
        q = random_device_array((batch, 32, 128), "float16", rng)
        k, v = random_kv_caches((pages, 16, 8, 128), "float16", rng, kv)
        cap = 30.0 if step % 2 else None
        out, lse = plan_and_run(wrapper, table, q, k, v, logits_soft_cap=cap)
        ref_out, ref_lse = reference_decode(q.get(), k, v, table, kv_dtype=kv,
                                            logits_soft_cap=cap)
        assert_matches_reference(to_float64(out), lse, ref_out, ref_lse, 1e-2, f"step {step}")
else:
    batch, pages_each = 16, 64
    wrapper = BatchDecodeWrapper(32, 8, 128, 16, "float16", use_cuda_graph=True,
                                 max_batch_size=batch, max_num_pages=batch * pages_each)
    count = wrapper.warmup()
    table = rng.permutation(batch * pages_each).reshape(batch, pages_each).astype(np.int32)
    k, v = random_kv_caches((batch * pages_each, 16, 8, 128), "float16", rng)
    q = random_device_array((batch, 32, 128), "float16", rng)
    k_dev, v_dev, table_dev = cupy.asarray(k), cupy.asarray(v), cupy.asarray(table)
    seq_lens = cupy.zeros(batch, cupy.int32)
    for step in range(4):
        rows = int(rng.integers(1, batch + 1))
        lens = rng.integers(1, pages_each * 16, rows).astype(np.int32)
        seq_lens[:rows] = cupy.asarray(lens)
        wrapper.plan_on_device(seq_lens=seq_lens[:rows], block_table=table_dev[:rows])
        out, lse = wrapper.run(q, k_dev, v_dev, return_lse=True)
        assert wrapper.device_plan_state()["error"] is None
        pt = PageTable.from_block_table(table[:rows], lens, 16)
        ref_out, ref_lse = reference_decode(q[:rows].get(), k, v, pt)
        assert_matches_reference(to_float64(out[:rows].get()), lse[:rows].get(), ref_out,
                                 ref_lse, 1e-2, f"step {step}")
cupy.cuda.runtime.deviceSynchronize()
print(json.dumps({"warmup": count, "origins": modules.module_origins(), "built": built}))
'''


def child_env(tmp_path: Path) -> dict:
    """A fresh process's environment: this checkout's splitkv, empty splitkv and CuPy caches of
    its own, and no first-use probes (they time kernels of their own: not what is counted)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPLITKV_PROFILE", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               SPLITKV_CACHE_DIR=str(tmp_path / "splitkv"), CUPY_CACHE_DIR=str(tmp_path / "cupy"),
               SPLITKV_FIRST_USE="off")
    return env


def run_child(args, env, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{args[:3]}: exit {done.returncode}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.parametrize("mode, kv_dtype, flags", [
    ("per_shape", "", ["--soft-cap"]),
    ("per_shape", "float8_e4m3fn", ["--soft-cap", "--kv-dtype", "float8_e4m3fn"]),
    ("graph_stable", "", ["--graph-stable"]),
], ids=["per-shape", "per-shape-fp8", "graph-stable"])
def test_a_fresh_process_after_precompile_compiles_nothing(mode, kv_dtype, flags, tmp_path):
    env = child_env(tmp_path)
    done = run_child(["-m", "splitkv", "precompile", "--heads", "32/8", "--head-dim", "128",
                      "--page-size", "16", "--dtype", "float16", "--jobs", "4", "--json",
                      *flags], env)
    written = json.loads(done.stdout)
    assert written["modules"] and all(m["status"] == "written" for m in written["modules"])
    assert all(Path(m["path"]).parent == tmp_path / "splitkv" / "kernels"
               for m in written["modules"])
    planner = [m for m in written["modules"] if m["label"] == "device_plan"]
    assert len(planner) == (mode == "graph_stable")

    served = json.loads(run_child(["-c", SERVE, mode, kv_dtype], env).stdout.splitlines()[-1])
    assert served["built"] == [], (
        "modules compiled from source after precompile (a planning kernel here means "
        f"device_planner.plan_kernel does not load through modules.load_module): "
        f"{served['built']}")
    assert served["origins"]["nvrtc"] == 0
    # warmup() compiled what precompile wrote, no more, no less: every decode build (and the
    # planning kernel) came from a file
    assert served["warmup"] == len(written["modules"]) - len(planner)
    assert served["origins"]["cubin"] == len(written["modules"])
