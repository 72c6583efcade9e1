"""splitkv.distributed: sharding, the merge of sharded states, the group adapters, the CPU path
of ContextParallelDecode in one process, the exchange kernels.

The CPU tests simulate the ranks in one process: each shard is computed with the CPU executor,
packed in the wire format, "all-gathered" by stacking, and merged exactly as the ranks do.
tests/distributed/test_distributed_gloo.py runs the same in real processes (torchrun, gloo).
The exchange kernels compile through NVRTC here (no GPU needed). The ``gpu`` tests run the
kernels against the host merge, and the example under torchrun: on one GPU through a torch NCCL
group and a CuPy communicator of world size 1 (the same code path as N ranks), and on two GPUs
where there are two.
"""

from __future__ import annotations

import os
import socket
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
from splitkv.core.bfloat16 import bits_to_float32 as bf16_bits_to_float32
from splitkv.core.bfloat16 import float32_to_bits as float32_to_bf16_bits
from splitkv.distributed.context_parallel import ContextParallelDecode
from splitkv.distributed.exchange_kernels import kernel_source
from splitkv.distributed.groups import ExchangeGroup, as_group
from splitkv.distributed.states import merge_gathered, pack_state, store_output
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import float_to_bits

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


# ------------------------------------------------------------ group adapters
class OneRank(ExchangeGroup):
    """A group of this process alone: the all-gather copies send into recv."""

    rank, world_size, device = 0, 1, "cpu"

    def bind_all_gather(self, send, recv):
        def all_gather(stream=None):
            recv.reshape(send.shape)[...] = send
        return all_gather

    def gather_host(self, values, stream=None):
        return np.asarray(values, dtype=np.float64).reshape(1, -1)

    def wait(self, stream=None):
        pass


class FakeCupyComm:
    """Looks like cupyx.distributed's NCCL backend to ``as_group`` (no GPU is touched)."""

    __module__ = "cupyx.distributed._nccl_comm"
    rank, _n_devices = 1, 4


def test_as_group_refuses_other_objects_by_name():
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup, None"):
        as_group(object())
    one = OneRank()
    assert as_group(one) is one


def test_as_group_none_needs_torchs_default_group():
    with pytest.raises(ValueError, match="group: None means torch.distributed's default group"):
        as_group(None)


def test_as_group_takes_a_cupy_communicator():
    group = as_group(FakeCupyComm(), timeout_s=7)
    assert (group.rank, group.world_size, group.device, group.timeout_s) == (1, 4, "cuda", 7.0)
    with pytest.raises(ValueError, match="device: a CuPy communicator exchanges CUDA buffers"):
        as_group(FakeCupyComm(), device="cpu")
    with pytest.raises(ValueError, match="timeout_s: expected > 0"):
        as_group(FakeCupyComm(), timeout_s=0)


# ------------------------------------------------------- the CPU path, one process
def batch_in(bt, dtype):
    if dtype == "float64":
        return bt.q, bt.k_cache, bt.v_cache
    return tuple(float_to_bits(x.astype(np.float32), dtype) for x in (bt.q, bt.k_cache, bt.v_cache))


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float16"])
def test_cpu_path_of_one_rank_matches_the_reference(make_batch, dtype):
    bt = make_batch(LENS, num_qo_heads=8, num_kv_heads=2)
    q, k, v = batch_in(bt, dtype)
    cp = ContextParallelDecode(OneRank(), 8, 2, 64, 16, dtype)
    assert cp.device == "cpu" and (cp.rank, cp.world_size) == (0, 1)
    cp.plan(bt.page_table, num_splits=2)
    out, lse = cp.run(q, k, v, return_lse=True)
    ref_out, ref_lse = reference_decode(q, k, v, bt.page_table)
    if dtype == "float64":
        assert out.dtype == np.float64 and lse.dtype == np.float64
        np.testing.assert_allclose(out, ref_out, **TOL)
        np.testing.assert_allclose(lse, ref_lse, **TOL)
        return
    assert out.dtype == (np.uint16 if dtype == "bfloat16" else np.float16)
    assert lse.dtype == np.float32
    got = to_float64(out) if dtype == "bfloat16" else out.astype(np.float64)
    assert np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out) < 1e-2
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(lse[~finite]))


def test_cpu_path_refuses_by_name(make_batch):
    bt = make_batch([40, 3])
    with pytest.raises(TypeError, match="use_cuda_graph: the CPU path takes none of the GPU"):
        ContextParallelDecode(OneRank(), 4, 2, 64, 16, "bfloat16", use_cuda_graph=True)
    with pytest.raises(ValueError, match="dtype: the CPU path takes one of"):
        ContextParallelDecode(OneRank(), 4, 2, 64, 16, "float32")
    cp = ContextParallelDecode(OneRank(), 4, 2, 64, 16, "float64")
    with pytest.raises(RuntimeError, match=r"run: call plan\(\) first"):
        cp.run(bt.q, bt.k_cache, bt.v_cache)
    with pytest.raises(TypeError, match="unified_max: the CPU path's plan"):
        cp.plan(bt.page_table, unified_max=1.0)
    with pytest.raises(ValueError, match="qo_indptr: context-parallel decode takes one query row"):
        cp.plan(bt.page_table, qo_indptr=[0, 1, 2])
    # positions measured from a rank's shard would be wrong: refused, arrays too
    for name, value in (("qo_indptr", np.array([0, 1, 2])), ("window_left", 100),
                        ("attention_chunk_size", 64), ("alibi_slopes", np.ones(4))):
        with pytest.raises(ValueError, match=f"{name}: context-parallel decode takes one query"):
            cp.plan(bt.page_table, **{name: value})
    with pytest.raises(ValueError, match="page_table: page_size 8, expected 16"):
        cp.plan(PageTable.from_block_table([[0], [1]], [5, 3], 8))
    cp.plan(bt.page_table)
    with pytest.raises(TypeError, match="out: expected dtype float64"):
        cp.run(bt.q, bt.k_cache, bt.v_cache, out=np.empty(bt.q.shape, np.float32))
    with pytest.raises(ValueError, match="lse: expected shape"):
        cp.run(bt.q, bt.k_cache, bt.v_cache, lse=np.empty(3))


def test_context_parallel_refuses_query_rows_by_name():
    """A rank's shard does not know the request's positions: several query rows are refused
    before anything is built (plan() refuses qo_indptr and window_left the same way)."""
    with pytest.raises(ValueError, match="max_q_len: context-parallel decode has one query row"):
        ContextParallelDecode(None, 32, 8, 128, 16, max_q_len=4, use_cuda_graph=True)


# ------------------------------------------------------------ exchange kernels
def test_exchange_kernel_source_needs_a_16_bit_dtype():
    assert kernel_source("bfloat16").startswith("#define OUT_BF16 1\n")
    assert kernel_source("float16").startswith("#define OUT_BF16 0\n")
    with pytest.raises(ValueError, match="dtype: expected 'bfloat16' or 'float16'"):
        kernel_source("float32")


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_exchange_kernels_compile_without_spills(dtype, arch):
    from splitkv.runtime.kernel_source import compile_cubin

    cubin, log = compile_cubin(kernel_source(dtype), arch, f"exchange_{dtype}.cu", verbose=True)
    assert cubin[:4] == b"\x7fELF"
    spills = [line for line in log.splitlines() if "spill" in line]
    assert len(spills) == 2, log
    assert all("0 bytes spill stores, 0 bytes spill loads" in s for s in spills), log


@pytest.mark.nvrtc
def test_exchange_kernels_need_their_define():
    from splitkv.distributed.exchange_kernels import KERNEL_SOURCE
    from splitkv.runtime.kernel_source import compile_cubin

    with pytest.raises(RuntimeError, match="OUT_BF16 must be defined"):
        compile_cubin(KERNEL_SOURCE, "sm_90", "exchange.cu")


# ----------------------------------------------------------------------- GPU
def gpus_for_torchrun() -> tuple[int, str]:
    """(GPUs, "") where the torchrun GPU tests can run, else (0, the skip reason)."""
    from splitkv.runtime import gpu_available

    ok, reason = gpu_available()
    if not ok:   # no CuPy, no driver or no device: one reason, as conftest gives the gpu tests
        return 0, f"no usable GPU: {reason}"
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, "torch is not installed (torchrun and its NCCL group)"
    if not (dist.is_available() and dist.is_nccl_available()):
        return 0, "this torch has no NCCL"
    import cupy

    return cupy.cuda.runtime.getDeviceCount(), ""


def needs_gpus(n: int):
    count, reason = gpus_for_torchrun()
    return pytest.mark.skipif(count < n, reason=reason or f"needs {n} GPUs, found {count}")


def test_without_a_gpu_the_gpu_tests_skip_saying_there_is_none(monkeypatch):
    import splitkv.runtime

    why = "CuPy found no usable CUDA device (no GPU or no driver)"
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (False, why))
    assert gpus_for_torchrun() == (0, f"no usable GPU: {why}")


def gpu_torchrun(nproc: int, *argv, timeout=300):
    """``torchrun --nproc-per-node nproc argv...`` on a free port, NVLink multicast off."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                           "--max-restarts", "0", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    return proc, time.monotonic() - t0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_exchange_kernels_match_the_host_merge(rng, dtype):
    """pack_state bit for bit; the fused merge-and-cast within one unit in the last place of
    the 16-bit output (float32 sums in another order), the host merge's non-finite rules."""
    import cupy

    from splitkv.distributed.exchange_kernels import launch_merge, launch_pack

    ranks, batch, hq, d = 4, 5, 8, 128
    o = rng.standard_normal((ranks, batch, hq, d)).astype(np.float32)
    lse = (rng.standard_normal((ranks, batch, hq)) * 5).astype(np.float32)
    lse[:, 0] = -np.inf                  # request 0: empty on every rank
    lse[1:3, 1] = -np.inf                # request 1: two ranks hold none of it
    o[1, 1, 0, 7] = np.nan               # ... and a NaN in an empty state reaches the output
    lse[2, 2, 3] = np.nan                # a non-finite score on one rank
    lse[0, 3, 5] = np.inf
    o16 = float_to_bits(o, dtype)
    gathered = np.empty((ranks, batch, hq, d + 1), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    for r in range(ranks):
        pack_state(o16[r], lse[r], gathered[r], dtype)
        send = cupy.full((batch, hq, d + 1), 7.0, cupy.float32)
        launch_pack(cupy.asarray(o16[r]), cupy.asarray(lse[r]), send, dtype, stream)
        stream.synchronize()
        np.testing.assert_array_equal(send.get(), gathered[r])
    want_o, want_lse = merge_gathered(gathered)
    want = np.empty((batch, hq, d), np.uint16 if dtype == "bfloat16" else np.float16)
    store_output(want_o, want, dtype)
    out = cupy.zeros((batch, hq, d), cupy.uint16)
    lse_out = cupy.zeros((batch, hq), cupy.float32)
    launch_merge(cupy.asarray(gathered), out.data.ptr, lse_out.data.ptr, dtype, stream)
    stream.synchronize()
    got_bits, want_bits = out.get(), want.view(np.uint16)
    got_f = (bf16_bits_to_float32(got_bits) if dtype == "bfloat16"
             else got_bits.view(np.float16).astype(np.float32))
    want_f = want_o if dtype == "bfloat16" else want.astype(np.float32)
    nan = np.isnan(want_f)
    np.testing.assert_array_equal(np.isnan(got_f), nan)
    assert np.all(np.abs(got_bits[~nan].astype(np.int32) - want_bits[~nan].astype(np.int32)) <= 1)
    assert np.all(np.isnan(got_f[2, 3])) and np.all(np.isnan(got_f[3, 5]))
    assert np.all(got_f[0] == 0) and np.isnan(got_f[1, 0, 7])
    got_lse = lse_out.get()
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    assert np.all(np.isneginf(got_lse[0]))
    out2 = cupy.zeros_like(out)                   # no LSE wanted: the same output
    launch_merge(cupy.asarray(gathered), out2.data.ptr, 0, dtype, stream)
    stream.synchronize()
    np.testing.assert_array_equal(out2.get(), got_bits)


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("group", ["torch", "cupy"])
def test_one_gpu_group_runs_the_n_rank_path(group):
    """World size 1: the same plan, pack, all-gather and merge as N ranks, through a torch NCCL
    group or a CuPy communicator, equal to one GPU; a captured call replays to the same bits."""
    proc, _ = gpu_torchrun(1, "examples/context_parallel.py", "--check", "--graph",
                           "--group", group, "--timeout", "120")
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("rel_l2 vs one GPU") == 1
    assert "graph: replay matches eager" in proc.stdout or (
        group == "torch" and "graph: capture failed" in proc.stdout), proc.stdout


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_context_parallel_matches_one_gpu(dtype):
    proc, _ = gpu_torchrun(2, "examples/context_parallel.py", "--check", "--graph",
                           "--dtype", dtype, "--timeout", "120")
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("rel_l2 vs one GPU") == 2


@pytest.mark.gpu
@needs_gpus(2)
def test_a_rank_that_raises_fails_every_rank(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent("""
        import datetime, os
        import cupy, numpy as np, torch, torch.distributed as dist
        from torch.distributed.elastic.multiprocessing.errors import record
        from splitkv.distributed import ContextParallelDecode
        from splitkv.measure.test_data import random_device_array, scattered_page_table

        @record
        def main():
            local = int(os.environ["LOCAL_RANK"])
            cupy.cuda.Device(local).use()
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                                    timeout=datetime.timedelta(seconds=60))
            rng = np.random.default_rng(0)
            table, pages = scattered_page_table([5000], 16, rng)
            q = random_device_array((1, 8, 128), "bfloat16", rng)
            k = random_device_array((pages, 16, 2, 128), "bfloat16", rng)
            cp = ContextParallelDecode(dist.group.WORLD, 8, 2, 128, 16, "bfloat16")
            cp.plan(table)
            if cp.rank == 1:
                raise RuntimeError("boom on rank 1")
            cp.run(q, k, k)          # its peer never joins the all-gather
            cp.group.wait()

        main()
    """))
    proc, elapsed = gpu_torchrun(2, str(script), timeout=240)
    assert proc.returncode != 0
    assert elapsed < 180, "the surviving rank was not stopped"
    assert "boom on rank 1" in proc.stderr
    root = proc.stderr[proc.stderr.index("Root Cause"):] if "Root Cause" in proc.stderr else ""
    assert "rank      : 1" in root, proc.stderr[-4000:]
