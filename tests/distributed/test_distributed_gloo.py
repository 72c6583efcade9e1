"""Context parallelism in real processes on the CPU: torchrun starts 2 or 4 ranks, each joins a
gloo group, runs ``ContextParallelDecode``'s CPU path on its shard and exchanges its state with
the others (gloo_worker.py). The results are compared with one process: the float64 path with
the float64 reference over the whole batch, the bfloat16 and float16 paths bit for bit with the
same steps run in this process. The failure tests check that a rank that fails, or never joins
the exchange, ends the job within the group's timeout and that torchrun names it.

Needs torch (with torch.distributed and gloo); skipped without it, as in the README's test run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gloo tests run "
                            "context parallelism through torch.distributed)")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

from splitkv import reference_decode  # noqa: E402
from splitkv.distributed import shard_page_table  # noqa: E402
from splitkv.distributed.host_decode import HostDecode, storage_dtype  # noqa: E402
from splitkv.distributed.states import merge_gathered, pack_state, store_output  # noqa: E402
from splitkv.measure.test_data import float_to_bits  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("gloo_worker.py")
LENS = [0, 1, 3, 15, 16, 17, 100, 257, 1000]
HQ, HK, D, PAGE = 8, 2, 64, 16
TOL = dict(rtol=1e-12, atol=1e-12)
JOB_TIMEOUT_S = 150          # the whole torchrun job; the tests' groups time out far sooner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, tmp_path: Path, mode: str, group_timeout_s: float = 30.0):
    """Run the worker in ``nproc`` ranks; returns (returncode, stderr, seconds). The job runs
    in a session of its own, killed whole if it outlives ``JOB_TIMEOUT_S``."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1",
               CP_TEST_TIMEOUT=str(group_timeout_s))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           "--monitor-interval", "0.2", str(WORKER), str(tmp_path / "data.npz"), str(tmp_path),
           mode]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun ({mode}, {nproc} ranks) still ran after {JOB_TIMEOUT_S} s")
    return proc.returncode, err, time.monotonic() - t0


@pytest.fixture
def batch(make_batch, tmp_path):
    """The batch, written for the ranks: float64, bfloat16 bits and float16 copies."""
    bt = make_batch(LENS, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PAGE)
    arrays = {}
    for name, x in (("q", bt.q), ("k", bt.k_cache), ("v", bt.v_cache)):
        arrays[f"{name}_float64"] = x
        arrays[f"{name}_bfloat16"] = float_to_bits(x.astype(np.float32), "bfloat16")
        arrays[f"{name}_float16"] = x.astype(np.float16)
    t = bt.page_table
    np.savez(tmp_path / "data.npz", kv_indptr=t.kv_indptr, kv_indices=t.kv_indices,
             kv_last_page_len=t.kv_last_page_len, page_size=t.page_size, **arrays)
    return bt, arrays


def one_process(bt, arrays, num_ranks: int, dtype: str):
    """The ranks' steps run here, one after another: each shard on the host executor, rounded,
    packed, stacked as the all-gather leaves them, merged and stored."""
    exact = dtype == "float64"
    wire = np.float64 if exact else np.float32
    q, k, v = (arrays[f"{n}_{dtype}"] for n in ("q", "k", "v"))
    gathered = np.empty((num_ranks,) + q.shape[:2] + (D + 1,), wire)
    for r, table in enumerate(shard_page_table(bt.page_table, num_ranks)):
        local = HostDecode(HQ, HK, D, PAGE, dtype)
        local.plan(table)
        o, lse = local.run(q, k, v)
        pack_state(o, lse, gathered[r], "float" if exact else dtype)
    out, lse = merge_gathered(gathered)
    if exact:
        return out, lse
    stored = np.empty(q.shape, storage_dtype(dtype))
    store_output(out, stored, dtype)
    return stored, lse


def rank_results(tmp_path, nproc):
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(nproc)]


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_merge_to_the_single_process_result(batch, tmp_path, nproc):
    bt, arrays = batch
    code, err, _ = torchrun(nproc, tmp_path, "merge")
    assert code == 0, err[-4000:]
    ranks = rank_results(tmp_path, nproc)
    ref_out, ref_lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    for r, res in enumerate(ranks):
        # float64: the exact merge of the shards is the reference over the whole batch
        np.testing.assert_allclose(res["out_float64"], ref_out, **TOL)
        np.testing.assert_allclose(res["lse_float64"], ref_lse, **TOL)
        np.testing.assert_allclose(res["out_split3"], ref_out, **TOL)       # 3 chunks a shard
        np.testing.assert_allclose(res["lse_split3"], ref_lse, **TOL)
        for dtype in ("bfloat16", "float16"):
            want_out, want_lse = one_process(bt, arrays, nproc, dtype)
            assert res[f"out_{dtype}"].dtype == want_out.dtype
            why = f"rank {r} {dtype}"
            np.testing.assert_array_equal(res[f"out_{dtype}"], want_out, err_msg=why)
            np.testing.assert_array_equal(res[f"lse_{dtype}"], want_lse, err_msg=why)
        assert "page_table: the ranks' batch sizes differ" in str(res["mismatch"]), res["mismatch"]
        assert "group: its backend is 'gloo'" in str(res["cuda_on_gloo"]), res["cuda_on_gloo"]
        for key in res:                                       # every rank holds the same answer
            if key not in ("mismatch", "cuda_on_gloo"):
                np.testing.assert_array_equal(res[key], ranks[0][key], err_msg=f"rank {r} {key}")
    if nproc == 4:     # two context-parallel sub-groups of 2 inside the world of 4
        for res in ranks:
            np.testing.assert_allclose(res["out_sub"], ref_out, **TOL)
            np.testing.assert_allclose(res["lse_sub"], ref_lse, **TOL)


def test_bfloat16_ranks_stay_within_bfloat16_of_the_reference(batch, tmp_path):
    """The 16-bit wire path (partials rounded once, merged in float32) against float64."""
    bt, arrays = batch
    out, lse = one_process(bt, arrays, 4, "bfloat16")
    from splitkv.core.reference import to_float64

    q, k, v = (arrays[f"{n}_bfloat16"] for n in ("q", "k", "v"))
    ref_out, ref_lse = reference_decode(q, k, v, bt.page_table)
    got = to_float64(out)
    assert np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out) < 1e-2
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(lse[~finite])) and np.all(got[~finite] == 0)


def test_a_rank_that_raises_ends_the_job_naming_it(batch, tmp_path):
    """Rank 1 raises after planning; rank 0's all-gather then fails too. Which of the two
    torchrun calls the root cause depends on which error file is stamped first, so the test
    asks only that rank 1 is listed among the failures with its own message."""
    code, err, elapsed = torchrun(2, tmp_path, "raise")
    assert code != 0
    assert elapsed < 90, "the surviving rank was not stopped"
    assert "boom on rank 1" in err
    report = err[err.index("Failures:"):] if "Failures:" in err else err
    assert "rank      : 1" in report, err[-3000:]


def test_a_rank_that_never_joins_times_out(batch, tmp_path):
    """Rank 1 sleeps instead of exchanging: rank 0's all-gather gives up after the group's
    timeout (3 s) with an error naming it, and torchrun stops rank 1."""
    code, err, elapsed = torchrun(2, tmp_path, "stall", group_timeout_s=3.0)
    assert code != 0
    assert elapsed < 90, "nothing stopped the job after the group's timeout"
    assert "rank 0 of 2: the all-gather of the attention states failed" in err, err[-3000:]
    root = err[err.index("Root Cause"):] if "Root Cause" in err else err
    assert "rank      : 0" in root, err[-3000:]
