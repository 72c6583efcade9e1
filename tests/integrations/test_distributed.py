"""splitkv.distributed: sharding, the merge of sharded states, the launcher, the rendezvous.

The CPU tests simulate the ranks in one process: each shard is computed with the CPU executor,
packed in the wire format, "all-gathered" by stacking, and merged exactly as the GPU path does.
The launcher tests run plain Python children (no GPU). The ``gpu`` tests need two GPUs, CuPy
and NCCL; they run the example and a failing script under the launcher.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from splitkv import (DecodeProblem, PageTable, execute_plan_cpu, merge_states_n, plan_fixed_splits,
                     reference_decode)
from splitkv.distributed import compact_page_table, head_shard, shard_page_table, shard_token_ranges
from splitkv.distributed.launch import child_env, split_argv
from splitkv.distributed.rendezvous import RankInfo, publish_unique_id, unique_id_path, wait_unique_id
from splitkv.core.bfloat16 import bits_to_float32 as bf16_bits_to_float32
from splitkv.core.bfloat16 import float32_to_bits as float32_to_bf16_bits
from splitkv.distributed.states import merge_gathered, pack_state, store_output
from splitkv.core.reference import to_float64
from splitkv.runtime.testing import float_to_bits

REPO = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-12, atol=1e-12)
LENS = [0, 1, 3, 15, 16, 17, 100, 257, 1000]


def assert_matches_unsharded(bt, out, lse):
    """The merged result equals the reference over the whole, unsharded batch."""
    ref_out, ref_lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


def run_sharded(bt, num_ranks, num_splits=1, wire_dtype=np.float64):
    """Each rank's state on its shard (CPU executor), packed, stacked as the all-gather would
    leave them, and merged. Returns (out, lse, the per-rank page tables)."""
    shards = shard_page_table(bt.page_table, num_ranks)
    gathered = np.empty((num_ranks,) + bt.q.shape[:2] + (bt.q.shape[2] + 1,), dtype=wire_dtype)
    for r, table in enumerate(shards):
        problem = DecodeProblem.from_page_table(table, *bt.q.shape[1:2], bt.k_cache.shape[2],
                                                bt.q.shape[2])
        strategy = "single" if num_splits == 1 else "split_merge"
        plan = plan_fixed_splits(problem, num_splits, strategy)
        o, lse = execute_plan_cpu(plan, bt.q, bt.k_cache, bt.v_cache, table)
        pack_state(o, lse, gathered[r], "float")
    out, lse = merge_gathered(gathered)
    return out, lse, shards


# ------------------------------------------------------------------ sharding
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_shards_cover_every_token_once_in_order(make_batch, num_ranks, page_size):
    bt = make_batch(LENS, page_size=page_size)
    shards = shard_page_table(bt.page_table, num_ranks)
    start, end = shard_token_ranges(bt.page_table, num_ranks)
    assert len(shards) == num_ranks
    for b, n in enumerate(LENS):
        slots = np.concatenate([t.token_slots(b) for t in shards])
        np.testing.assert_array_equal(slots, bt.page_table.token_slots(b))
        np.testing.assert_array_equal([t.kv_lens[b] for t in shards], end[:, b] - start[:, b])
        assert start[0, b] == 0 and end[-1, b] == n
        np.testing.assert_array_equal(start[1:, b], end[:-1, b])          # contiguous ranges
        assert np.all((start[:, b] % page_size == 0) | (start[:, b] == n))  # page-aligned
        pages = -(-n // page_size)
        owned = -(-(end[:, b] - start[:, b]) // page_size)
        assert owned.max() - owned.min() <= 1 or pages < num_ranks          # balanced by pages


def test_shard_worked_example():
    table = PageTable.from_block_table(np.arange(8)[None].repeat(2, 0), [100, 3], 16)
    start, end = shard_token_ranges(table, 4)
    np.testing.assert_array_equal(end[:, 0] - start[:, 0], [16, 32, 32, 20])
    np.testing.assert_array_equal(end[:, 1] - start[:, 1], [0, 0, 0, 3])


def test_shard_page_table_rejects_bad_input(make_batch):
    bt = make_batch([10])
    with pytest.raises(ValueError, match="num_ranks"):
        shard_page_table(bt.page_table, 0)
    with pytest.raises(TypeError, match="page_table"):
        shard_page_table(np.zeros(3), 2)


def test_compact_page_table_reads_the_same_tokens(make_batch):
    bt = make_batch([40, 0, 7], spare_pages=9)
    for table in shard_page_table(bt.page_table, 3) + [bt.page_table]:
        local, page_ids = compact_page_table(table)
        assert local.kv_indices.size == 0 or local.kv_indices.max() == page_ids.size - 1
        np.testing.assert_array_equal(local.kv_lens, table.kv_lens)
        got = reference_decode(bt.q, bt.k_cache[page_ids], bt.v_cache[page_ids], local)
        want = reference_decode(bt.q, bt.k_cache, bt.v_cache, table)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


# ------------------------------------------------------- sharded attention
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sharded_states_merge_to_the_reference(make_batch, num_ranks, num_splits):
    bt = make_batch(LENS, num_qo_heads=8, num_kv_heads=2)
    out, lse, _ = run_sharded(bt, num_ranks, num_splits)
    assert_matches_unsharded(bt, out, lse)


def test_merge_states_n_on_the_shards_directly(make_batch):
    bt = make_batch([300, 5], num_qo_heads=4, num_kv_heads=4)
    states = [reference_decode(bt.q, bt.k_cache, bt.v_cache, t) for t in shard_page_table(bt.page_table, 3)]
    out, lse = merge_states_n(np.stack([s[0] for s in states]), np.stack([s[1] for s in states]))
    assert_matches_unsharded(bt, out, lse)


def test_requests_shorter_than_the_number_of_ranks(make_batch):
    bt = make_batch([1, 2, 3], page_size=1)
    out, lse, shards = run_sharded(bt, 8)
    assert min(int(t.kv_lens.sum()) for t in shards) == 0      # some ranks hold nothing at all
    assert_matches_unsharded(bt, out, lse)


def test_zero_length_requests_stay_zero_and_minus_inf(make_batch):
    bt = make_batch([0, 50, 0], page_size=16)
    out, lse, _ = run_sharded(bt, 4)
    assert np.all(out[[0, 2]] == 0) and np.all(np.isneginf(lse[[0, 2]]))
    assert_matches_unsharded(bt, out, lse)


def test_all_requests_empty(make_batch):
    bt = make_batch([0, 0])
    out, lse, _ = run_sharded(bt, 2)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_bfloat16_wire_path_within_bf16_tolerance(make_batch):
    """What the GPU does: partials rounded to bfloat16, sent as float32, merged, rounded."""
    bt = make_batch([2000, 37, 0, 5], num_qo_heads=8, num_kv_heads=2, head_dim=128)
    shards = shard_page_table(bt.page_table, 4)
    gathered = np.empty((4,) + bt.q.shape[:2] + (129,), dtype=np.float32)
    for r, table in enumerate(shards):
        o, lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, table)
        pack_state(float_to_bits(o, "bfloat16"), lse.astype(np.float32), gathered[r], "bfloat16")
    merged, merged_lse = merge_gathered(gathered)
    out = np.empty(bt.q.shape, dtype=np.uint16)
    store_output(merged, out, "bfloat16")
    ref_out, ref_lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    got = to_float64(out)
    assert np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out) < 1e-2
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(merged_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(merged_lse[~finite])) and np.all(got[~finite] == 0)


@pytest.mark.parametrize("as_bits", [False, True])
def test_float16_wire_path(make_batch, as_bits):
    """float16 partials (native, or as uint16 bits) through the float32 wire format."""
    bt = make_batch([300, 0, 9], num_qo_heads=4, num_kv_heads=2)
    gathered = np.empty((3,) + bt.q.shape[:2] + (65,), dtype=np.float32)
    for r, table in enumerate(shard_page_table(bt.page_table, 3)):
        o, lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, table)
        o16 = o.astype(np.float16)
        pack_state(o16.view(np.uint16) if as_bits else o16, lse, gathered[r], "float16")
    merged, _ = merge_gathered(gathered)
    out = np.empty(bt.q.shape, dtype=np.uint16 if as_bits else np.float16)
    store_output(merged, out, "float16")
    got = (out.view(np.float16) if as_bits else out).astype(np.float64)
    ref_out, _ = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    assert np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out) < 5e-3


def test_bfloat16_conversions(rng):
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 1000),
                        np.array([0.0, -0.0, 1.0, np.inf, -np.inf], np.float32)]).astype(np.float32)
    bits = float32_to_bf16_bits(x)
    np.testing.assert_array_equal(bits, float_to_bits(x, "bfloat16"))
    back = bf16_bits_to_float32(bits)
    np.testing.assert_array_equal(float32_to_bf16_bits(back), bits)     # exact round trip
    finite = np.isfinite(x)
    assert np.all(np.abs(back[finite] - x[finite]) <= np.abs(x[finite]) * 2.0 ** -8)
    np.testing.assert_array_equal(back[~finite], x[~finite])


# ------------------------------------------------------------ head parallel
@pytest.mark.parametrize("hq,hk,ranks", [(32, 8, 2), (32, 8, 8), (8, 8, 4), (12, 4, 4)])
def test_head_shards_give_the_full_output(make_batch, hq, hk, ranks):
    bt = make_batch([40, 0, 9], num_qo_heads=hq, num_kv_heads=hk, head_dim=64)
    ref_out, ref_lse = reference_decode(bt.q, bt.k_cache, bt.v_cache, bt.page_table)
    pieces = []
    for r in range(ranks):
        qo, kv = head_shard(hq, hk, r, ranks)
        out, _ = reference_decode(np.ascontiguousarray(bt.q[:, qo]), bt.k_cache[:, :, kv],
                                  bt.v_cache[:, :, kv], bt.page_table)
        pieces.append(out)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), ref_out, **TOL)


def test_head_shard_rejects_uneven_splits():
    with pytest.raises(ValueError, match="num_kv_heads"):
        head_shard(32, 8, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        head_shard(32, 8, 2, 2)


# ---------------------------------------------------------------- rendezvous
def test_unique_id_round_trip(tmp_path):
    uid = bytes(range(128))
    publish_unique_id(tmp_path, uid)
    assert wait_unique_id(tmp_path, timeout_s=1.0) == uid
    assert [p.name for p in tmp_path.iterdir()] == [unique_id_path(tmp_path).name]   # no temp left


def test_unique_id_wait_times_out(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0 did not publish"):
        wait_unique_id(tmp_path, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_unique_id_ignores_a_half_written_temp_file(tmp_path):
    (tmp_path / ".nccl-unique-id-world.123.tmp").write_text("ab")
    with pytest.raises(TimeoutError):
        wait_unique_id(tmp_path, timeout_s=0.1)


def test_rank_info_from_env():
    info = RankInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "SPLITKV_RENDEZVOUS_DIR": "/tmp/x"})
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 1)
    assert RankInfo.from_env({}).world_size == 1
    with pytest.raises(ValueError, match="SPLITKV_RENDEZVOUS_DIR"):
        RankInfo.from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="rank"):
        RankInfo.from_env({"RANK": "2", "WORLD_SIZE": "2", "SPLITKV_RENDEZVOUS_DIR": "/tmp/x"})


# ------------------------------------------------------------------ launcher
def launch(tmp_path, script: str, *options, timeout=60):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               NCCL_NVLS_ENABLE="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "splitkv.distributed.launch", *options, str(path),
                           str(tmp_path), "--child-flag"], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    return proc, time.monotonic() - t0


def test_launcher_sets_the_environment(tmp_path):
    proc, _ = launch(tmp_path, """
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_NVLS_ENABLE", "SPLITKV_RENDEZVOUS_DIR"]
        info = {k: os.environ[k] for k in keys}
        info["argv"] = sys.argv[1:]
        info["dir_exists"] = os.path.isdir(os.environ["SPLITKV_RENDEZVOUS_DIR"])
        open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w").write(json.dumps(info))
    """, "--nproc", "3")
    assert proc.returncode == 0, proc.stderr
    import json
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [i["RANK"] for i in infos] == ["0", "1", "2"]
    assert {i["WORLD_SIZE"] for i in infos} == {"3"}
    assert {i["NCCL_NVLS_ENABLE"] for i in infos} == {"0"}        # forced off, even if set to 1
    assert all(i["dir_exists"] for i in infos) and len({i["SPLITKV_RENDEZVOUS_DIR"] for i in infos}) == 1
    assert not os.path.exists(infos[0]["SPLITKV_RENDEZVOUS_DIR"])   # removed afterwards
    assert infos[0]["argv"] == [str(tmp_path), "--child-flag"]


def test_launcher_stops_everyone_when_a_rank_fails(tmp_path):
    proc, elapsed = launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(1)
        time.sleep(120)
    """, "--nproc", "3", "--grace", "2")
    assert proc.returncode == 1
    assert elapsed < 30
    assert "rank 1 exited with status 1" in proc.stderr
    assert "rank 0" in proc.stderr and "stopped by the launcher" in proc.stderr


def test_launcher_reports_a_rank_killed_by_a_signal(tmp_path):
    proc, elapsed = launch(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """, "--nproc", "2", "--grace", "2")
    assert proc.returncode != 0 and elapsed < 30
    assert "rank 0 was killed by SIGKILL" in proc.stderr


def test_launcher_stops_a_rank_that_ignores_sigterm(tmp_path):
    proc, elapsed = launch(tmp_path, """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            sys.exit(2)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    """, "--nproc", "2", "--grace", "1")
    assert proc.returncode == 2 and elapsed < 30


def test_launcher_timeout(tmp_path):
    proc, elapsed = launch(tmp_path, """
        import time
        time.sleep(120)
    """, "--nproc", "2", "--timeout", "1", "--grace", "1")
    assert proc.returncode == 124 and elapsed < 30
    assert "timed out" in proc.stderr


def test_unique_id_timeout_under_the_launcher(tmp_path):
    """Rank 0 never publishes: rank 1 gives up after --rendezvous-timeout, and the launcher
    reports it instead of waiting."""
    proc, elapsed = launch(tmp_path, """
        import os, time
        from splitkv.distributed.rendezvous import RankInfo, wait_unique_id
        info = RankInfo.from_env()
        if info.rank == 0:
            time.sleep(120)
        wait_unique_id(info.rendezvous_dir, info.timeout_s)
    """, "--nproc", "2", "--rendezvous-timeout", "0.5", "--grace", "2")
    assert proc.returncode == 1 and elapsed < 30
    assert "TimeoutError" in proc.stderr and "rank 1 exited with status 1" in proc.stderr


def test_split_argv_keeps_the_childs_options():
    assert split_argv(["--nproc", "2", "s.py", "--nproc", "9"]) == (
        ["--nproc", "2"], ["s.py", "--nproc", "9"])
    assert split_argv(["--nproc=2", "--isolate-devices", "-m", "pkg.mod", "-x"]) == (
        ["--nproc=2", "--isolate-devices"], ["-m", "pkg.mod", "-x"])


def test_child_env_isolates_devices():
    env = child_env(1, 2, "/tmp/r", 5.0, True, base={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and env["LOCAL_RANK"] == "0"
    env = child_env(1, 2, "/tmp/r", 5.0, False, base={})
    assert env["LOCAL_RANK"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


# ----------------------------------------------------------------------- GPU
def two_gpus_with_nccl() -> tuple[bool, str]:
    """(True, "") where the GPU tests can run, else (False, the skip reason)."""
    from splitkv.runtime import gpu_available

    ok, reason = gpu_available()
    if not ok:   # no CuPy, no driver or no device: one reason, as conftest gives the gpu tests
        return False, f"no usable GPU: {reason}"
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        return False, f"needs 2 GPUs, found {count}"
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return False, f"CuPy's NCCL bindings cannot be imported ({exc})"
    if not nccl.available:
        return False, "CuPy's NCCL bindings are unusable (pip install 'nvidia-nccl-cu13>=2.27.7,<3')"
    return True, ""


def test_without_a_gpu_the_gpu_tests_skip_saying_there_is_none(monkeypatch):
    import splitkv.runtime

    why = "CuPy found no usable CUDA device (no GPU or no driver)"
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (False, why))
    assert two_gpus_with_nccl() == (False, f"no usable GPU: {why}")


def gpu_launch(*argv, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "splitkv.distributed.launch", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return proc, time.monotonic() - t0


needs_two_gpus = pytest.mark.skipif(not two_gpus_with_nccl()[0], reason=two_gpus_with_nccl()[1])


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_context_parallel_matches_one_gpu(dtype):
    proc, _ = gpu_launch("--nproc", "2", "--timeout", "240", "examples/context_parallel.py",
                         "--check", "--dtype", dtype)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("rel_l2 vs one GPU") == 2


@pytest.mark.gpu
@needs_two_gpus
def test_a_rank_that_raises_fails_every_rank(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent("""
        import cupy, numpy as np
        from splitkv.distributed import ContextParallelDecode, init_process_group
        from splitkv.runtime.testing import random_device_array, scattered_page_table
        group = init_process_group()
        rng = np.random.default_rng(0)
        table, pages = scattered_page_table([5000], 16, rng)
        q = random_device_array((1, 8, 128), "bfloat16", rng)
        k = random_device_array((pages, 16, 2, 128), "bfloat16", rng)
        cp = ContextParallelDecode(group, 8, 2, 128, 16, "bfloat16")
        cp.plan(table)
        if group.rank == 1:
            raise RuntimeError("boom on rank 1")
        cp.run(q, k, k)          # its peer never joins the all-gather
        group.wait(timeout_s=200)
    """))
    proc, elapsed = gpu_launch("--nproc", "2", "--timeout", "240", "--grace", "3", str(script))
    assert proc.returncode != 0
    assert elapsed < 180, "the surviving rank was not stopped"
    assert "boom on rank 1" in proc.stderr
    assert re.search(r"rank 1 (\(pid \d+\): )?exited with status 1", proc.stderr), proc.stderr
    # rank 0 was stopped by the launcher, or NCCL noticed the abort first and it failed itself
    assert re.search(r"rank 0 \(pid \d+\): (stopped by the launcher|exited with status [1-9])",
                     proc.stderr), proc.stderr


def test_context_parallel_refuses_query_rows_by_name():
    """A rank's shard does not know the request's positions: several query rows are refused
    before anything is built (plan() refuses qo_indptr and window_left the same way)."""
    from splitkv.distributed.context_parallel import ContextParallelDecode

    with pytest.raises(ValueError, match="max_q_len: context-parallel decode has one query row"):
        ContextParallelDecode(None, 32, 8, 128, 16, max_q_len=4, use_cuda_graph=True)
