"""Streams, threads and memory on the GPU. Two wrappers on two streams at once are each
correct; one wrapper's run() called from two threads at once, with different inputs and a
fused (ticket) plan, is correct (its runs share the workspace, so runs on two streams are
ordered one after the other: ``records.StreamChain``); runs on two other streams are both
followed by the next plan's upload; a plan made while the current stream still writes
memory it just freed takes none of it for its buffers; run() with
its outputs given allocates nothing, and the wrapper reports the workspace it holds; a K/V
pool past 2**31 elements, read near its end, gives the reference's answer; 1,000 random
ragged batches (every strategy the planner picks, the variants mixed in) all match the
float64 reference."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, random_device_array,
                                       scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

HQ, HK, D = 32, 8, 128


def batch(rng, lens, page=16):
    pt, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), HQ, D), "bfloat16", rng)
    k, v = (random_device_array((num_pages, page, HK, D), "bfloat16", rng) for _ in range(2))
    ref = reference_decode(q.get(), k.get(), v.get(), pt)
    return pt, q, k, v, ref


def check(out, lse, ref, what):
    cupy.cuda.runtime.deviceSynchronize()
    assert_matches_reference(to_float64(out.get()), lse.get(), *ref, 1e-2, what)


def poisoned(q):
    """Poisoned out and lse, filled before any later stream's work (a synchronize)."""
    out = (cupy.full(q.shape, 0xFFFF, cupy.uint16), cupy.full(q.shape[:2], np.nan, cupy.float32))
    cupy.cuda.runtime.deviceSynchronize()
    return out


def test_two_wrappers_on_two_streams_at_once():
    rng = np.random.default_rng(1)
    cases = [batch(rng, [5000, 30, 2000]), batch(rng, [100] * 40)]
    wrappers = [BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16") for _ in cases]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in cases]
    outs = [poisoned(c[1]) for c in cases]
    for w, (pt, *_), s in zip(wrappers, cases, streams):
        w.plan(pt, stream=s, num_splits=3, strategy="fused")
    for _ in range(50):      # interleaved launches: both streams busy at once
        for w, (pt, q, k, v, _), s, (o, lse) in zip(wrappers, cases, streams, outs):
            w.run(q, k, v, out=o, lse=lse, stream=s)
    for (o, lse), c in zip(outs, cases):
        check(o, lse, c[4], "two wrappers, two streams")


@pytest.mark.parametrize("strategy,splits", [("fused", 4), ("split_merge", 4)])
def test_one_wrapper_run_from_two_threads_at_once(strategy, splits):
    """Different q in each thread (the same pages): each thread's output is its own q's."""
    rng = np.random.default_rng(2)
    pt, q, k, v, ref = batch(rng, [3000, 700, 9, 4100])
    q2 = random_device_array(q.shape, "bfloat16", rng)
    ref2 = reference_decode(q2.get(), k.get(), v.get(), pt)
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16", use_clusters=False)
    plan = w.plan(pt, num_splits=splits, strategy=strategy)
    assert plan.merge == ("ticket" if strategy == "fused" else "merge_kernel")
    outs = [poisoned(q), poisoned(q2)]
    errors = []

    def worker(i):
        try:
            with cupy.cuda.Device(0):
                s = cupy.cuda.Stream(non_blocking=True)
                for _ in range(200):
                    w.run((q, q2)[i], k, v, out=outs[i][0], lse=outs[i][1], stream=s)
                s.synchronize()
        except Exception as exc:       # surfaced below, with the thread's traceback lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check(*outs[0], ref, f"thread 0, {plan}")
    check(*outs[1], ref2, f"thread 1, {plan}")


def test_the_next_plan_follows_runs_on_two_other_streams():
    """Runs on streams A then B (neither the plan's), then a plan of another batch: its upload
    must wait for both runs, not only B's (A's run is made slow by its size)."""
    rng = np.random.default_rng(3)
    big = batch(rng, [60000] * 8)
    small = batch(rng, [50])
    w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
    plan_stream, a, b = (cupy.cuda.Stream(non_blocking=True) for _ in range(3))
    w.plan(big[0], stream=plan_stream)
    o_a, lse_a = poisoned(big[1])
    o_b, lse_b = poisoned(big[1])
    for _ in range(20):              # A is busy long after B's one run
        w.run(big[1], big[2], big[3], out=o_a, lse=lse_a, stream=a)
    w.run(big[1], big[2], big[3], out=o_b, lse=lse_b, stream=b)
    w.plan(small[0], stream=plan_stream)
    check(o_a, lse_a, big[4], "the run on stream A")
    check(o_b, lse_b, big[4], "the run on stream B")


@pytest.mark.parametrize("graph_stable", [False, True], ids=["per-shape", "graph-stable"])
def test_a_plan_while_the_current_stream_still_writes_blocks_it_freed(graph_stable):
    """A caller fills large random arrays on the current stream and drops the temporaries
    (benchmark data, a model's weights), then plans and runs on a non-blocking stream at once:
    the wrapper's buffers (records, page table, partials) must not be blocks those queued
    kernels still write, or the run reads garbage page indices (an illegal address)."""
    rng = np.random.default_rng(5)
    pt, q, k, v, ref = batch(rng, [32768])
    s = cupy.cuda.Stream(non_blocking=True)
    kw = dict(use_cuda_graph=True, max_batch_size=1,
              max_num_pages=pt.kv_indices.size) if graph_stable else {}
    BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16", **kw).plan(pt, stream=s)  # the build, compiled
    for trial in range(3):
        out, lse = poisoned(q)
        cupy.get_default_memory_pool().free_all_blocks()
        for i in range(8):       # ~3 GiB written on the current stream, freed as queued
            x = cupy.random.default_rng(i).standard_normal(1 << 26, dtype=cupy.float32)
            y = (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
            del x, y
        w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16", **kw)
        w.plan(pt, stream=s)
        w.run(q, k, v, out=out, lse=lse, stream=s)
        check(out, lse, ref, f"trial {trial}")


def test_run_with_outputs_given_allocates_nothing():
    rng = np.random.default_rng(4)
    pt, q, k, v, ref = batch(rng, [3000, 700, 9, 4100])
    pool = cupy.get_default_memory_pool()
    for strategy, n in (("single", 1), ("split_merge", 4), ("fused", 4), ("fused", 2)):
        w = BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16")
        plan = w.plan(pt, num_splits=n, strategy=strategy)
        o, lse = poisoned(q)
        w.run(q, k, v, out=o, lse=lse)
        cupy.cuda.runtime.deviceSynchronize()
        gc.collect()                 # the previous wrapper's buffers, freed before measuring
        used, total = pool.used_bytes(), pool.total_bytes()
        for _ in range(20):
            w.run(q, k, v, out=o, lse=lse)
        cupy.cuda.runtime.deviceSynchronize()
        assert (pool.used_bytes(), pool.total_bytes()) == (used, total), plan
        assert w.workspace_bytes >= plan.workspace_bytes
        if plan.merge in ("merge_kernel", "ticket"):
            assert plan.workspace_bytes == plan.num_chunks * HQ * (D + 1) * 4 > 0
        check(o, lse, ref, str(plan))


def test_a_pool_past_two_to_the_31_elements_read_near_its_end():
    """4.3 GB K and V pools (2**31 + elements each): the pages used are the last ones, so
    every address is past what a 32-bit element offset holds."""
    rng = np.random.default_rng(5)
    page, lens = 16, [3000, 40, 1500]
    per_page = page * HK * D
    num_pages = 2**31 // per_page + 64
    pages_needed = sum(-(-n // page) for n in lens)
    ids = np.arange(num_pages - pages_needed, num_pages, dtype=np.int32)
    rng.shuffle(ids)
    pt, _ = scattered_page_table(lens, page, rng, extra_pages=0)
    from splitkv.core.problem import PageTable

    far = PageTable(pt.kv_indptr, ids[pt.kv_indices], pt.kv_last_page_len, page)
    k = cupy.zeros((num_pages, page, HK, D), cupy.uint16)
    v = cupy.zeros((num_pages, page, HK, D), cupy.uint16)
    assert k.size > 2**31
    k_used = random_device_array((pages_needed, page, HK, D), "bfloat16", rng)
    v_used = random_device_array((pages_needed, page, HK, D), "bfloat16", rng)
    k[num_pages - pages_needed:] = k_used
    v[num_pages - pages_needed:] = v_used
    q = random_device_array((len(lens), HQ, D), "bfloat16", rng)
    near = PageTable(pt.kv_indptr, ids[pt.kv_indices] - (num_pages - pages_needed),
                     pt.kv_last_page_len, page)
    ref = reference_decode(q.get(), k_used.get(), v_used.get(), near)
    w = BatchDecodeWrapper(HQ, HK, D, page, "bfloat16")
    for strategy, n in (("single", 1), ("split_merge", 3), ("fused", 3)):
        w.plan(far, num_splits=n, strategy=strategy)
        o, lse = poisoned(q)
        w.run(q, k, v, out=o, lse=lse)
        check(o, lse, ref, f"{strategy}/{n} near the end of a 2**31+ pool")
    del k, v
    cupy.get_default_memory_pool().free_all_blocks()


def test_a_thousand_random_ragged_batches_match_the_reference():
    rng = np.random.default_rng(6)
    hq, hk, d = 8, 2, 64
    w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16")
    seen = set()
    for i in range(1000):
        lens = rng.integers(0, 3000, int(rng.integers(1, 9)))
        pt, num_pages = scattered_page_table(lens, 16, rng)
        q = random_device_array((len(lens), hq, d), "bfloat16", rng)
        k, v = (random_device_array((num_pages, 16, hk, d), "bfloat16", rng) for _ in range(2))
        cap = 20.0 if i % 3 == 0 else None
        sinks = rng.standard_normal(hq).astype(np.float32) if i % 4 == 0 else None
        ref = reference_decode(q.get(), k.get(), v.get(), pt, logits_soft_cap=cap,
                               sinks=None if sinks is None else sinks.astype(np.float64))
        forced = [{}, {"num_splits": int(rng.integers(1, 9)), "strategy": "split_merge"},
                  {"num_splits": int(rng.integers(1, 9)), "strategy": "fused"}][i % 3]
        plan = w.plan(pt, logits_soft_cap=cap, **forced)
        seen.add(plan.merge)
        o, lse = poisoned(q)
        w.run(q, k, v, out=o, lse=lse, sinks=None if sinks is None else cupy.asarray(sinks))
        check(o, lse, ref, f"batch {i}: {plan}")
    assert {"none", "merge_kernel", "ticket"} <= seen, seen
