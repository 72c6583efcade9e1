"""The planner on the device (``plan_on_device``) on the GPU: the kernel writes the host planner's
records bit for bit, and one CUDA graph holding the planning kernel and the decode kernels replays
1,000+ steps of a decode loop (lengths grow, requests join and leave, plans change) with the bits
of an eager run of the host's plan, with no host work per step but updating the engine's arrays."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import PageTable

from helpers.device_plan_reference import comparable_records, expected, layout_arrays, records_equal

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

DTYPE = "bfloat16"
# the default builds' pipeline depth (head_dim 64: 3 stages under core.builds.default_occupancy)
STAGES = {64: 3, 128: 3, 256: 2}


@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_writes_the_host_planners_records(seed):
    """Random batches of every kind, both layouts, three shapes and page sizes: the records,
    merge_indptr, strategy and prediction the kernel writes are the host planner's."""
    from splitkv import BatchDecodeWrapper
    from splitkv.testing import scattered_page_table

    rng = np.random.default_rng(seed)
    for trial in range(12):
        hq, hk, d = [(32, 8, 128), (64, 8, 128), (8, 1, 64), (16, 4, 256)][trial % 4]
        page = [16, 1, 64][trial % 3]
        batch = int(rng.integers(1, 200))
        lens = (rng.lognormal(np.log(2048), 1.3, batch).clip(0, 50000).astype(np.int64)
                if trial % 3 else np.full(batch, int(rng.integers(0, 30000))))
        lens[rng.random(batch) < 0.1] = 0
        table, pool = scattered_page_table(lens, page, rng, 2)
        layout = ("block_table", "flashinfer")[trial % 2]
        arrays = layout_arrays(table, layout, rng, spare_columns=1)
        w = BatchDecodeWrapper(hq, hk, d, page, DTYPE, use_cuda_graph=True,
                               max_batch_size=batch + 3, max_num_pages=max(a.size for a in arrays))
        dev = [cupy.asarray(a) for a in arrays]
        names = ("seq_lens", "block_table") if layout == "block_table" else (
            "kv_indptr", "kv_last_page_len", "kv_indices")
        w.plan_on_device(**dict(zip(names, dev)))
        state = w.device_plan_state()
        assert w.kernel_build.stages == STAGES[d]       # the records' pages follow the stages
        records, merge_indptr = w._device_planner.written()
        model = w.profile.cost_model(graph_stable=True)       # the model plan_on_device has
        plan, want, want_indptr = expected(table, model, num_qo_heads=hq,
                                           num_kv_heads=hk, head_dim=d, stages=STAGES[d],
                                           max_batch=batch + 3, max_chunks=w.max_chunks_for(batch),
                                           launch_order="longest_chunks")
        n = plan.num_chunks
        have, want = comparable_records(records[:n], want, table, layout, arrays)
        what = f"seed {seed} trial {trial}: {plan}"
        assert state["error"] is None and state["num_chunks"] == n, what
        assert (state["strategy"], state["predicted_us"]) == (plan.strategy, plan.predicted_us)
        assert records_equal(have, want), what
        assert np.all(records["request"][n:] == -1), what
        np.testing.assert_array_equal(merge_indptr, want_indptr, err_msg=what)


HQ, HK, D, PAGE = 32, 8, 128, 16
MAX_BATCH, POOL_PAGES, WIDTH = 8, 4096, 640


class SlotLoop:
    """A decode loop in an engine's fixed slots: seq_lens [MAX_BATCH] and a block table
    [MAX_BATCH, WIDTH] updated in place; an empty slot has length 0. Lengths grow by one a step;
    requests leave and join."""

    def __init__(self, rng):
        self.rng = rng
        self.lens = np.zeros(MAX_BATCH, np.int32)
        self.table = rng.integers(0, POOL_PAGES, (MAX_BATCH, WIDTH)).astype(np.int32)
        for slot in range(3):
            self._join(slot)

    def _join(self, slot):
        self.lens[slot] = int(self.rng.choice([1, 40, 700, 3000, 9000]) + self.rng.integers(0, 30))
        self.table[slot] = self.rng.integers(0, POOL_PAGES, WIDTH)

    def step(self):
        self.lens[self.lens > 0] += 1
        busy = np.flatnonzero(self.lens)
        if self.rng.random() < 0.05 and busy.size > 1:
            self.lens[self.rng.choice(busy)] = 0
        free = np.flatnonzero(self.lens == 0)
        if self.rng.random() < 0.07 and free.size:
            self._join(int(self.rng.choice(free)))

    def page_table(self) -> PageTable:
        return PageTable.from_block_table(self.table, self.lens, PAGE, num_pages=POOL_PAGES)


def test_one_graph_with_the_planner_replays_a_thousand_steps_bit_identically():
    """Graph = plan_on_device, then run() for two layers; each step the host only writes the
    new lengths, pages and queries. Each step's outputs equal, bit for bit, an eager run of the
    host planner's plan of the same batch; the device's choice is the host's."""
    from splitkv import BatchDecodeWrapper
    from splitkv.measure.test_data import random_device_array

    rng = np.random.default_rng(77)
    layers = [(random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng),
               random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)) for _ in range(2)]
    q = random_device_array((MAX_BATCH, HQ, D), DTYPE, rng)
    outs = [cupy.zeros((MAX_BATCH, HQ, D), dtype=q.dtype) for _ in layers]
    lses = [cupy.zeros((MAX_BATCH, HQ), dtype=cupy.float32) for _ in layers]
    capacity = dict(use_cuda_graph=True, max_batch_size=MAX_BATCH,
                    max_num_pages=MAX_BATCH * WIDTH)
    device = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, **capacity)
    host = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, **capacity)
    loop = SlotLoop(rng)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:                  # the engine's arrays, made on its stream
        seq_lens = cupy.asarray(loop.lens)
        block_table = cupy.asarray(loop.table)
    device.plan_on_device(seq_lens=seq_lens, block_table=block_table, stream=stream)
    stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
    device.plan_on_device(seq_lens=seq_lens, block_table=block_table, stream=stream)
    for (k, v), out, lse in zip(layers, outs, lses):
        device.run(q, k, v, out=out, lse=lse, stream=stream)
    graph = stream.end_capture()
    seen = set()
    for step in range(1050):
        loop.step()
        seq_lens.set(loop.lens, stream=stream)
        block_table.set(loop.table, stream=stream)
        with stream:
            q[...] = random_device_array(q.shape, DTYPE, rng)
        graph.launch(stream)
        plan = host.plan(loop.page_table(), stream=stream)
        seen.add((plan.strategy, plan.num_chunks > MAX_BATCH))
        for (k, v), out, lse in zip(layers, outs, lses):
            want_o = cupy.full((MAX_BATCH, HQ, D), 0xFFFF, dtype=cupy.uint16)
            want_lse = cupy.full((MAX_BATCH, HQ), np.nan, dtype=cupy.float32)
            host.run(q, k, v, out=want_o, lse=want_lse, stream=stream)
            stream.synchronize()
            np.testing.assert_array_equal(out.view(cupy.uint16).get(), want_o.get(),
                                          err_msg=f"step {step}: {plan}")
            np.testing.assert_array_equal(lse.get(), want_lse.get(), err_msg=f"step {step}")
        if step % 50 == 0:
            state = device.device_plan_state()
            assert (state["strategy"], state["num_chunks"], state["predicted_us"]) == (
                plan.strategy, plan.num_chunks, plan.predicted_us), f"step {step}"
            assert state["error"] is None
    assert device.device_plan_state()["plans"] == 1051
    assert {s for s, _ in seen} >= {"single", "split_merge"}, seen


def test_eager_plan_then_run_sees_each_new_plan():
    """plan_on_device() and run() back to back with no graph, the plan changing every step:
    the first run after the planning kernel must not read its records early (PDL)."""
    from splitkv import BatchDecodeWrapper
    from splitkv.measure.test_data import random_device_array

    rng = np.random.default_rng(5)
    k = random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)
    v = random_device_array((POOL_PAGES, PAGE, HK, D), DTYPE, rng)
    q = random_device_array((MAX_BATCH, HQ, D), DTYPE, rng)
    capacity = dict(use_cuda_graph=True, max_batch_size=MAX_BATCH,
                    max_num_pages=MAX_BATCH * WIDTH)
    device = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, **capacity)
    host = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, **capacity)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:                  # the engine's arrays, made on its stream
        lens = cupy.zeros(MAX_BATCH, cupy.int32)
        table = cupy.asarray(rng.integers(0, POOL_PAGES, (MAX_BATCH, WIDTH)).astype(np.int32))
    for step in range(200):
        # alternate long and short batches, so that consecutive plans differ
        new = (rng.integers(5000, 10000, MAX_BATCH) if step % 2 else
               rng.integers(0, 300, MAX_BATCH)).astype(np.int32)
        lens.set(new, stream=stream)
        device.plan_on_device(seq_lens=lens, block_table=table, stream=stream)
        out = device.run(q, k, v, stream=stream)
        host.plan(PageTable.from_block_table(table.get(), new, PAGE), stream=stream)
        want = host.run(q, k, v, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(out.view(cupy.uint16).get(),
                                      want.view(cupy.uint16).get(), err_msg=f"step {step}")


def test_invalid_device_values_are_reported_not_read():
    """A negative length and a request with more pages than its row: planned as empty (nothing
    read past the table: the memcheck run covers this test), the first error reported."""
    from splitkv import BatchDecodeWrapper
    from splitkv.measure.test_data import random_device_array

    rng = np.random.default_rng(9)
    k = random_device_array((64, PAGE, HK, D), DTYPE, rng)
    v = random_device_array((64, PAGE, HK, D), DTYPE, rng)
    q = random_device_array((4, HQ, D), DTYPE, rng)
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True, max_batch_size=4,
                           max_num_pages=64)
    table = cupy.asarray(rng.integers(0, 64, (4, 16)).astype(np.int32))
    lens = cupy.asarray(np.array([100, -3, 16 * 17, 50], np.int32))
    w.plan_on_device(seq_lens=lens, block_table=table)
    out, lse = w.run(q, k, v, return_lse=True)
    state = w.device_plan_state()
    assert state["error"] == "a negative sequence length" and state["error_request"] == 1
    assert np.all(np.isneginf(lse[1:3].get())) and not cupy.any(out[1:3].view(cupy.uint16)).get()
    w.clear_device_plan_error()
    lens.set(np.array([100, 3, 16 * 17, 50], np.int32))
    w.plan_on_device(seq_lens=lens, block_table=table)
    state = w.device_plan_state()
    assert state["error"] == "more pages than its block-table row holds"
    assert state["error_request"] == 2


def test_plan_on_device_misuse_is_refused():
    from splitkv import BatchDecodeWrapper

    lens = cupy.zeros(4, cupy.int32)
    table = cupy.zeros((4, 8), cupy.int32)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE).plan_on_device(seq_lens=lens, block_table=table)
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True, max_batch_size=4,
                           max_num_pages=64)
    w.plan_on_device(seq_lens=lens, block_table=table)
    with pytest.raises(ValueError, match="sm_scale: a graph-stable wrapper keeps"):
        w.plan_on_device(seq_lens=cupy.zeros(4, cupy.int32), block_table=table, sm_scale=0.5)
    with pytest.raises(ValueError, match="seq_lens: 5 requests"):
        w.plan_on_device(seq_lens=cupy.zeros(5, cupy.int32), block_table=cupy.zeros((5, 8),
                                                                                   cupy.int32))
    with pytest.raises(RuntimeError, match="plans on the device"):
        w.plan(PageTable.from_block_table(np.zeros((4, 8), np.int32), [1, 1, 1, 1], PAGE))
    stream = cupy.cuda.Stream(non_blocking=True)
    fresh = BatchDecodeWrapper(HQ, HK, D, PAGE, DTYPE, use_cuda_graph=True, max_batch_size=4,
                               max_num_pages=64)
    stream.begin_capture()
    try:
        with pytest.raises(RuntimeError, match="before capturing"):
            fresh.plan_on_device(seq_lens=lens, block_table=table, stream=stream)
    finally:
        stream.end_capture()
