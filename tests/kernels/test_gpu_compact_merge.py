"""The compact merge experiment (``DecodeExperiments(compact_merge=True)``: the merge kernel
runs a thread per (split request, head, 4 dims), not per request of the whole batch) gives the
whole-batch merge's bits, plan for plan: ragged batches where a few requests split and where
all do, empty requests, multi-token rows, sinks and the soft cap, fp8 K/V; its merge grid is
the split requests' size; fused plans and graph-stable wrappers are left as they were."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import DecodeProblem, plan_chunk_tokens, reference_decode
from splitkv.core.reference import to_float64
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.testing import (assert_matches_reference, plan_and_run, plan_and_run_both,
                                     random_device_array, random_kv_caches,
                                     scattered_page_table)
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

COMPACT = DecodeExperiments(compact_merge=True)


def merge_ctas(w) -> int:
    return int(w._launch.merge._config.grid[0]) if w._launch.merge is not None else 0


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("chunk", [1024, 300, 64])
def test_the_compact_merge_gives_the_whole_batch_merges_bits(kv_dtype, chunk):
    rng = np.random.default_rng(chunk)
    hq, hk, d = 32, 8, 128
    lens = [140] * 40 + [3000, 0, 1500] + [90] * 20       # a few split at 1024, most at 64
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((len(lens), hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng, kv_dtype)
    plan = plan_chunk_tokens(DecodeProblem.from_page_table(pt, hq, hk, d), chunk, "split_merge")
    split = int((np.diff(plan.merge_indptr) > 1).sum())
    whole = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", kv_dtype=kv_dtype)
    compact = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", kv_dtype=kv_dtype,
                                 experiments=COMPACT)
    o2, l2 = plan_and_run_both(whole, compact, pt, q, k, v, f"chunks of {chunk}", plan=plan)
    threads = compact.kernel_variant.threads
    assert merge_ctas(compact) == -(-split * hq * (d // 4) // threads)
    assert merge_ctas(whole) == -(-len(lens) * hq * (d // 4) // threads)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)
    assert_matches_reference(to_float64(o2), l2, ref_o, ref_lse, 1e-2, f"chunks of {chunk}")


def test_the_compact_merge_with_query_rows_sinks_and_a_soft_cap():
    rng = np.random.default_rng(3)
    hq, hk, d = 32, 8, 64
    lens = [2000, 50, 700, 33, 0]
    pt, pages = scattered_page_table(lens, 16, rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng)
    qo_indptr = np.array([0, 3, 4, 6, 7, 8])         # a request with no KV still has its row
    q = random_device_array((8, hq, d), "bfloat16", rng)
    sinks = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
    whole = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16")
    compact = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", experiments=COMPACT)
    outs = []
    for w in (whole, compact):
        w.plan(pt, strategy="split_merge", num_splits=4, qo_indptr=qo_indptr,
               logits_soft_cap=30.0)
        out = cupy.full(q.shape, 0xFFFF, cupy.uint16)
        lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
        w.run(q, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse, sinks=sinks)
        outs.append((out.get(), lse.get()))
    assert np.array_equal(outs[0][0], outs[1][0])
    assert np.array_equal(outs[0][1].view(np.uint32), outs[1][1].view(np.uint32))
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, qo_indptr=qo_indptr,
                                      logits_soft_cap=30.0, sinks=sinks.get().astype(np.float64))
    assert_matches_reference(to_float64(outs[1][0]), outs[1][1], ref_o, ref_lse, 1e-2,
                             "multi-token, sinks, cap")


def test_fused_plans_and_graph_stable_wrappers_keep_their_merges():
    rng = np.random.default_rng(4)
    hq, hk, d = 32, 8, 128
    lens = [3000, 100, 100]
    pt, pages = scattered_page_table(lens, 16, rng)
    q = random_device_array((3, hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    compact = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", experiments=COMPACT)
    o, lse = plan_and_run(compact, pt, q, k, v, strategy="fused", num_splits=4)
    assert merge_ctas(compact) == 0 and not compact._launch.params.split_requests
    assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, "fused")
    g = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", experiments=COMPACT, use_cuda_graph=True,
                           max_batch_size=3, max_num_pages=pt.kv_indices.size)
    o, lse = plan_and_run(g, pt, q, k, v, strategy="split_merge", num_splits=4)
    assert not g._launch.params.split_requests
    assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, "graph-stable")
