"""A graph-stable wrapper (``use_cuda_graph=True``): one CUDA graph, captured once, replays a
decode loop of 1,000+ steps in which every request grows by a token per step, requests join and
leave (the batch moves between 1 and the capacity), and the plan's strategy and split count
change; every step gives the bits of an eager run of the same plan by an ordinary wrapper."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import PageTable

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

HQ, HK, D, PAGE, DTYPE = 32, 8, 128, 16, "bfloat16"
MAX_BATCH, POOL_PAGES = 8, 4096


class DecodeLoop:
    """Requests with random page lists (pages may repeat across requests: the math does not
    care) whose lengths grow by one per step; some leave and new ones join."""

    def __init__(self, rng, steps: int):
        self.rng, self.steps = rng, steps
        self.requests = [self._new() for _ in range(3)]

    def _new(self):
        length = int(self.rng.choice([1, 40, 700, 3000, 9000]) + self.rng.integers(0, 30))
        pages = self.rng.integers(0, POOL_PAGES, -(-(length + self.steps) // PAGE))
        return [length, pages]

    def step(self) -> PageTable:
        for r in self.requests:
            r[0] += 1
        if self.rng.random() < 0.05 and len(self.requests) > 1:
            self.requests.pop(int(self.rng.integers(len(self.requests))))
        if self.rng.random() < 0.06 and len(self.requests) < MAX_BATCH:
            self.requests.insert(int(self.rng.integers(len(self.requests) + 1)), self._new())
        lens = np.array([r[0] for r in self.requests])
        width = max(len(r[1]) for r in self.requests)
        table = np.zeros((len(lens), width), dtype=np.int64)
        for b, (_, pages) in enumerate(self.requests):
            table[b, :len(pages)] = pages
        return PageTable.from_block_table(table, lens, PAGE, num_pages=POOL_PAGES)


# Every 50 steps the plan is forced another way, so the captured grid sees every strategy.
FORCED = [dict(), dict(strategy="single"), dict(num_splits=5, strategy="split_merge"),
          dict(num_splits=3, strategy="fused"), dict(strategy="fused"),
          dict(num_splits=6, strategy="split_merge")]


def test_one_graph_replays_a_thousand_changing_plans_bit_identically():
    from splitkv import BatchDecodeWrapper
    from splitkv.measure.test_data import random_device_array

    rng = np.random.default_rng(2024)
    k = random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)
    v = random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)
    q = random_device_array((MAX_BATCH, HQ, D), DTYPE, rng)
    out = cupy.zeros((MAX_BATCH, HQ, D), dtype=q.dtype)
    lse = cupy.zeros((MAX_BATCH, HQ), dtype=cupy.float32)
    # a capacity of 100 chunks, so that 8 requests may be forced into 6 chunks each
    stable = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True,
                                max_batch_size=MAX_BATCH, max_num_pages=MAX_BATCH * 1400,
                                max_chunks=100)
    eager = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_clusters=False)
    loop = DecodeLoop(rng, steps=1100)
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, seen = None, set()
    for step in range(1100):
        table = loop.step()
        plan = stable.plan(table, stream=stream, **FORCED[(step // 50) % len(FORCED)])
        assert plan.merge != "cluster" and plan.num_chunks <= stable.max_chunks
        seen.add((plan.strategy, plan.num_splits))
        with stream:                                 # new queries, in the captured buffer
            q[...] = random_device_array(q.shape, DTYPE, rng)
        if graph is None:
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
            stable.run(q, k, v, out=out, lse=lse, stream=stream)
            graph = stream.end_capture()
        graph.launch(stream)
        batch = table.batch_size
        want_o = cupy.full((batch, HQ, D), 0xFFFF, dtype=cupy.uint16)
        want_lse = cupy.full((batch, HQ), np.nan, dtype=cupy.float32)
        eager.plan(table, plan=plan, stream=stream)
        eager.run(q[:batch], k, v, out=want_o, lse=want_lse, stream=stream)
        stream.synchronize()
        assert eager.current_plan.merge == plan.merge
        np.testing.assert_array_equal(out[:batch].view(cupy.uint16).get(), want_o.get(),
                                      err_msg=f"step {step}: {plan}")
        np.testing.assert_array_equal(lse[:batch].get(), want_lse.get(), err_msg=f"step {step}")
    strategies = {s for s, _ in seen}
    assert strategies == {"single", "split_merge", "fused"} and len(seen) >= 8, seen


def test_capacity_is_enforced_before_any_upload():
    from splitkv import BatchDecodeWrapper

    rng = np.random.default_rng(1)
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True, max_batch_size=2,
                           max_num_pages=128, max_chunks=8)
    small = PageTable.from_block_table(rng.integers(0, 32, (2, 38)), [600, 500], PAGE)
    assert w.plan(small).num_chunks <= 8
    with pytest.raises(ValueError, match="max_batch_size"):
        w.plan(PageTable.from_block_table(rng.integers(0, 32, (3, 1)), [5, 5, 5], PAGE))
    with pytest.raises(ValueError, match="max_num_pages"):
        w.plan(PageTable.from_block_table(rng.integers(0, 32, (2, 80)), [1280, 1280], PAGE))
    with pytest.raises(ValueError, match="max_chunks"):
        w.plan(small, num_splits=8, strategy="fused")
    with pytest.raises(RuntimeError, match="captured"):
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.begin_capture()
        try:
            w.plan(small, stream=stream)
        finally:
            stream.end_capture()
    assert w.current_plan.problem.batch_size == 2           # the refused plans changed nothing
    k = cupy.zeros((64, PAGE, HK, D), dtype=cupy.uint16)
    q = cupy.zeros((2, HQ, D), dtype=cupy.uint16)
    with pytest.raises(ValueError, match="q"):
        w.run(q[:1], k, k)                                   # q has max_batch_size rows
    w.run(q, k[:32], k[:32])                                 # a pool of 32 pages from now on
    with pytest.raises(ValueError, match="past the K/V pool"):
        w.plan(PageTable.from_block_table([[40], [1]], [5, 5], PAGE))


def test_runs_on_another_stream_are_ordered_with_the_next_plan():
    """plan() on one stream, many eager runs on another, the next plan() at once: every run
    reads the plan it was given (the next upload waits for them), as an ordinary wrapper's."""
    from splitkv import BatchDecodeWrapper
    from splitkv.measure.test_data import random_device_array

    rng = np.random.default_rng(3)
    k = random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)
    v = random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)
    q = random_device_array((MAX_BATCH, HQ, D), DTYPE, rng)
    stable = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True,
                                max_batch_size=MAX_BATCH, max_num_pages=MAX_BATCH * 1400)
    eager = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_clusters=False)
    plan_stream, run_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    loop = DecodeLoop(rng, steps=40)
    steps = []
    for _ in range(40):                       # no host wait: the next plan() comes at once
        table = loop.step()
        plan = stable.plan(table, stream=plan_stream)
        outs = [stable.run(q, k, v, stream=run_stream) for _ in range(8)]
        eager.plan(table, plan=plan, stream=run_stream)
        steps.append((table.batch_size, outs, eager.run(q[:table.batch_size], k, v,
                                                          stream=run_stream)))
    run_stream.synchronize()
    for batch, outs, want in steps:
        for out in outs:
            np.testing.assert_array_equal(out[:batch].view(cupy.uint16).get(),
                                          want.view(cupy.uint16).get())


def test_each_batch_size_runs_the_grid_of_its_own_capacity():
    """A large capacity (an engine's 256) runs a small batch in the grid a wrapper of that
    batch's capacity would have (not 256 requests' worth of CTAs that only exit), host-planned
    and device-planned, graphs per batch size replaying correctly side by side."""
    from splitkv import BatchDecodeWrapper, reference_decode
    from splitkv.core.reference import to_float64
    from splitkv.measure.test_data import random_device_array

    def stable(cap, **kw):
        return BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True,
                                  max_batch_size=cap, max_num_pages=cap * 64, **kw)

    big = stable(256)
    for batch in (1, 4, 16, 17, 64, 256):
        assert big.max_chunks_for(batch) == stable(batch).max_chunks, batch
    assert stable(256, max_chunks=4000).max_chunks_for(1) == 4000     # given: one fixed grid

    rng = np.random.default_rng(5)
    pool = 512
    k = random_device_array((pool, PAGE, HK, D), DTYPE, rng)
    v = random_device_array((pool, PAGE, HK, D), DTYPE, rng)
    k_host, v_host = k.get(), v.get()
    stream = cupy.cuda.Stream(non_blocking=True)
    for device_planned in (False, True):
        w = stable(256)
        graphs = {}
        for step in range(3):
            for batch in (1, 5, 40):
                lens = rng.integers(1, 1000, batch) + step
                table = rng.integers(0, pool, (batch, 64)).astype(np.int32)
                pt = PageTable.from_block_table(table, lens, PAGE)
                q = random_device_array((batch, HQ, D), DTYPE, rng)
                if batch not in graphs:
                    bufs = dict(q=q, out=cupy.full((batch, HQ, D), 0x7FC0, q.dtype),
                                seq_lens=cupy.asarray(lens.astype(np.int32)),
                                block_table=cupy.asarray(table))
                with stream:
                    if batch in graphs:
                        bufs = graphs[batch][1]
                        bufs["q"][...] = q
                        bufs["seq_lens"][...] = cupy.asarray(lens.astype(np.int32))
                        bufs["block_table"][...] = cupy.asarray(table)
                        bufs["out"].fill(0x7FC0)           # poisoned: NaN in bfloat16
                    if not device_planned:
                        w.plan(pt, stream=stream)
                    if batch not in graphs:
                        if device_planned:         # the first call binds, outside the capture
                            w.plan_on_device(seq_lens=bufs["seq_lens"],
                                             block_table=bufs["block_table"], stream=stream)
                        stream.begin_capture()
                        if device_planned:
                            w.plan_on_device(seq_lens=bufs["seq_lens"],
                                             block_table=bufs["block_table"], stream=stream)
                        w.run(bufs["q"], k, v, out=bufs["out"], stream=stream)
                        graphs[batch] = (stream.end_capture(), bufs)
                    graphs[batch][0].launch(stream)
                stream.synchronize()
                want, _ = reference_decode(q.get(), k_host, v_host, pt)
                got = to_float64(graphs[batch][1]["out"])
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert err < 1e-2, (device_planned, step, batch, err)
        grids = {key: launch.partial.grid for key, launch in w._launches.items()}
        assert grids[1] < grids[40] < grids[256], grids
