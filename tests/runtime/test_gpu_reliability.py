"""Determinism on the GPU: outputs are bitwise deterministic over 1,000 runs for every strategy
(the cluster merge, fp8 K/V and graph-stable wrappers too), and one CUDA graph of many layers
replayed 10,000 times keeps giving the eager runs' bits (the fused merge's tickets wrap back to
zero on every replay)."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv.core import fp8
from splitkv.measure.test_data import random_device_array, scattered_page_table
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

RUNS = 1000
REPLAYS = 10_000
LENS = [3000, 700, 9, 4100]


def case(rng, kv_dtype=None):
    pt, num_pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), 32, 128), "bfloat16", rng)
    shape = (num_pages, 16, 8, 128)
    if kv_dtype:
        make = lambda: cupy.asarray(fp8.quantize(rng.standard_normal(shape), kv_dtype))  # noqa: E731
    else:
        make = lambda: random_device_array(shape, "bfloat16", rng)                        # noqa: E731
    return pt, q, make(), make()


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("strategy,splits,graph_stable", [
    ("single", 1, False), ("split_merge", 5, False), ("fused", 5, False),
    ("fused", 2, False),                 # two chunks a request: a cluster merge on sm_90
    ("fused", 5, True), ("split_merge", 5, True)])
def test_a_thousand_runs_give_the_same_bits(kv_dtype, strategy, splits, graph_stable):
    rng = np.random.default_rng(31)
    pt, q, k, v = case(rng, kv_dtype)
    kw = dict(use_cuda_graph=True, max_batch_size=len(LENS),
              max_num_pages=pt.kv_indices.size) if graph_stable else {}
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", kv_dtype=kv_dtype, **kw)
    w.plan(pt, num_splits=splits, strategy=strategy)
    out = cupy.empty(q.shape, cupy.uint16)
    lse = cupy.empty(q.shape[:2], cupy.float32)
    w.run(q, k, v, out=out, lse=lse)
    first_out, first_lse = out.copy(), lse.copy()
    assert np.isfinite(first_lse.get()).all()
    differs = cupy.zeros((), cupy.int32)
    for _ in range(RUNS - 1):
        out.fill(0xFFFF)                     # poisoned: a run that writes nothing shows
        lse.fill(np.nan)
        w.run(q, k, v, out=out, lse=lse)
        differs += cupy.any(out != first_out) | cupy.any(lse.view(cupy.uint32)
                                                          != first_lse.view(cupy.uint32))
    assert int(differs) == 0, f"{int(differs)} of {RUNS - 1} runs differ ({w.cluster_size=})"


@pytest.mark.parametrize("strategy,splits", [("fused", 5), ("split_merge", 5), ("fused", 2)])
def test_a_graph_of_eight_layers_replayed_ten_thousand_times(strategy, splits):
    rng = np.random.default_rng(32)
    pt, num_pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), 32, 128), "bfloat16", rng)
    layers = [(random_device_array((num_pages, 16, 8, 128), "bfloat16", rng),
               random_device_array((num_pages, 16, 8, 128), "bfloat16", rng)) for _ in range(8)]
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    w.plan(pt, num_splits=splits, strategy=strategy)
    eager = [w.run(q, k, v) for k, v in layers]
    outs = [cupy.full(q.shape, 0xFFFF, cupy.uint16) for _ in layers]
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    stream.begin_capture()
    for (k, v), out in zip(layers, outs):
        w.run(q, k, v, out=out, stream=stream)
    graph = stream.end_capture()
    for done in range(1, REPLAYS + 1):
        graph.launch(stream)
        if done % 2500 == 0:
            stream.synchronize()
            for i, (out, ref) in enumerate(zip(outs, eager)):
                assert cupy.array_equal(out, ref.view(cupy.uint16)), \
                    f"layer {i} differs from eager after {done} replays"
                with stream:                 # the next replays must write it again
                    out.fill(0xFFFF)
    stream.synchronize()


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn", "float8_e5m2"])
def test_the_bench_data_watch_finds_a_written_nan_and_where(kv_dtype):
    """``LayeredKV.non_finite`` (the bench's check before its error check): the random data as
    made is finite; a NaN (fp8: a NaN code; e5m2: an Inf code too) written into one layer, or
    into q, is found with its array and first index."""
    from splitkv.measure.timing import make_layers

    pt, _ = scattered_page_table([300, 40], 16, np.random.default_rng(1))
    data = make_layers(pt, 8, 2, 64, "bfloat16", min_total_bytes=1 << 20, kv_dtype=kv_dtype)
    assert data.non_finite(kv_dtype) == {} and data.num_layers >= 2
    code = {None: 0x7FC0, "float8_e4m3fn": 0xFF, "float8_e5m2": 0x7C}[kv_dtype]
    data.v_layers[1].ravel()[123] = code
    assert data.non_finite(kv_dtype) == {"v[1]": (1, 123)}
    data.q.ravel()[7] = 0xFF80                     # bfloat16 -inf
    assert data.non_finite(kv_dtype) == {"q": (1, 7), "v[1]": (1, 123)}
