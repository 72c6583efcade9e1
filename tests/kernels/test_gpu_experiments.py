"""The experiment knobs of ``DecodeExperiments`` (what ``benchmarks/ab.py`` times against the
shipped kernel) on the GPU, one table for all of them: each knob runs the build it names, on
every strategy, and answers as the float64 reference does; the knobs that only move data (q's
fragments in shared memory, the shifting page walk, the compact merge) give the default build's
bits, plan for plan. Below the table, each knob's other paths: clusters, graph-stable wrappers
planned on the host and on the device, multi-token rows, windows, sinks, the soft cap."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest

from splitkv import DecodeProblem, plan_chunk_tokens, plan_from_chunk_counts, reference_decode
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import (assert_matches_reference, assert_paths_match_reference,
                                       plan_and_run, plan_and_run_both, random_device_array,
                                       random_kv_caches, scattered_page_table)
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

# 63/65 and 127/129: a tile short of and past 64 and 128 tokens; 0: an empty request
LENS = [3000, 127, 0, 129, 63, 700]
PLANS = [("single", 1), ("split_merge", 3), ("fused", 4), ("fused", 2), ("split_merge", 16)]


@dataclass(frozen=True)
class Knob:
    """One setting: the experiments, the build fields it must run with, whether its bits must
    equal the default build's (``baseline``: the experiments of the build it replaces), and
    whether a graph-stable wrapper takes it too."""

    experiments: DecodeExperiments
    build: dict
    baseline: DecodeExperiments | None = None
    graph_stable: bool = False
    label: str = field(default="", compare=False)


Q_SMEM = Knob(DecodeExperiments(q_in_smem=True), {"q_in_smem": 1},
              baseline=DecodeExperiments(q_in_smem=False), label="q_in_smem")
POW2 = Knob(DecodeExperiments(pow2_pages=True), {"pow2_pages": 1},
            baseline=DecodeExperiments(pow2_pages=False), label="pow2_pages")
TILE_32 = Knob(DecodeExperiments(tile_per_warp=32), {"tile_tokens": 128, "num_warps": 4},
               label="tile_per_warp_32")
DIM_SPLIT = Knob(DecodeExperiments(dim_split=2), {"dim_split": 2, "num_warps": 8,
                                                  "tile_tokens": 64}, label="dim_split_2")
DIM_SPLIT_REGS = Knob(DecodeExperiments(dim_split=2, q_in_smem=False),
                      {"dim_split": 2, "num_warps": 8, "q_in_smem": 0},
                      label="dim_split_2_q_in_registers")
WARPS_8 = Knob(DecodeExperiments(warps=8), {"num_warps": 8}, graph_stable=True, label="eight_warps")
# the builds head_dim 256 gives way to at 99 KiB a block (sm_86/89/120, core.builds.fitting_build)
FIT_99_KIB = Knob(DecodeExperiments(dim_split=2, warps=4, stages=3, q_in_smem=False),
                  {"dim_split": 2, "num_warps": 4, "tile_tokens": 32, "stages": 3},
                  label="fit_99_kib_split")
FIT_99_KIB_FP8 = Knob(DecodeExperiments(warps=4, stages=3, q_in_smem=False),
                      {"num_warps": 4, "stages": 3, "q_in_smem": 0}, label="fit_99_kib_fp8")


def rows(n: int) -> Knob:
    return Knob(DecodeExperiments(rows_per_cta=n), {"rows": n}, label=f"rows_per_cta_{n}")


# (knob, dtype, head_dim, query heads, kv heads, page size, K/V format)
TABLE = [
    # q in shared memory: head_dim 256 (where it is the default) and below, fp8, fp16
    (Q_SMEM, "bfloat16", 256, 16, 8, 16, None), (Q_SMEM, "float16", 256, 32, 4, 16, None),
    (Q_SMEM, "bfloat16", 256, 16, 8, 16, "float8_e4m3fn"),
    (Q_SMEM, "bfloat16", 128, 32, 8, 16, None), (Q_SMEM, "bfloat16", 64, 64, 2, 16, "float8_e5m2"),
    # the shifting page walk: pages that walk by division (1, and 2 at head_dim 64), and 16
    (POW2, "bfloat16", 128, 32, 8, 1, None), (POW2, "bfloat16", 64, 32, 8, 1, None),
    (POW2, "bfloat16", 64, 32, 8, 2, None), (POW2, "bfloat16", 128, 32, 8, 16, None),
    (POW2, "bfloat16", 128, 32, 8, 1, "float8_e4m3fn"),
    # 128-token tiles: for rows of 128 bytes (16-bit d64, fp8 d128) and others
    (TILE_32, "bfloat16", 64, 32, 8, 16, None), (TILE_32, "bfloat16", 128, 32, 8, 16, "float8_e4m3fn"),
    (TILE_32, "bfloat16", 128, 64, 2, 16, "float8_e5m2"), (TILE_32, "bfloat16", 64, 32, 8, 1, None),
    (TILE_32, "bfloat16", 128, 32, 8, 16, None), (TILE_32, "bfloat16", 64, 128, 2, 16, None),
    # the head dim split between warp pairs; 128 query heads over 2: four row tiles, 8 warps
    *[(knob, dtype, d, hq, hk, page, None) for page in (16, 1) for knob, dtype, d, hq, hk in (
        (DIM_SPLIT, "bfloat16", 256, 16, 8), (DIM_SPLIT_REGS, "bfloat16", 256, 16, 8),
        (DIM_SPLIT, "float16", 256, 64, 2), (DIM_SPLIT, "bfloat16", 128, 32, 8),
        (DIM_SPLIT, "bfloat16", 128, 128, 2))],
    # head_dim 256 as it runs at 99 KiB a block: 32-token tiles of 4 warps in pairs (one and
    # two row tiles), fp8 at 3 stages
    *[(FIT_99_KIB, dtype, 256, hq, hk, page, None) for page in (16, 1)
      for dtype, hq, hk in (("bfloat16", 16, 8), ("float16", 64, 2))],
    (FIT_99_KIB_FP8, "bfloat16", 256, 16, 8, 16, "float8_e4m3fn"),
    # GQA groups past the rows a CTA computes: more CTAs a kv head
    (rows(16), "bfloat16", 128, 64, 2, 16, None), (rows(32), "bfloat16", 128, 64, 2, 16, None),
    (rows(16), "bfloat16", 128, 128, 8, 16, "float8_e4m3fn"),
    (rows(16), "bfloat16", 128, 32, 1, 16, None),
    # 8 warps (128-token tiles, 256 threads); bf16 d256 would need 256 KiB of shared memory
    (WARPS_8, "bfloat16", 128, 32, 8, 16, None), (WARPS_8, "bfloat16", 128, 32, 8, 16, "float8_e4m3fn"),
    (WARPS_8, "bfloat16", 64, 64, 2, 1, None), (WARPS_8, "bfloat16", 64, 64, 2, 1, "float8_e4m3fn"),
    (WARPS_8, "bfloat16", 256, 16, 16, 64, "float8_e4m3fn"),
    # head_dim 96's 12-chunk rows (copy slots past the row idle, their own swizzle) under each
    # knob that changes the copies or the d-tiles: 8 warps, 128-token tiles, the head dim split,
    # the shifting page walk, q in shared memory, four row tiles
    (WARPS_8, "bfloat16", 96, 32, 8, 16, None), (WARPS_8, "float16", 96, 64, 2, 1, None),
    (TILE_32, "bfloat16", 96, 32, 8, 16, None), (DIM_SPLIT, "bfloat16", 96, 32, 8, 16, None),
    (POW2, "bfloat16", 96, 32, 8, 1, None), (Q_SMEM, "float16", 96, 32, 4, 16, None),
    (rows(64), "bfloat16", 96, 64, 1, 16, None),
]


def case_id(row) -> str:
    knob, dtype, d, hq, hk, page, kv_dtype = row
    return f"{knob.label}-{dtype}-d{d}-{hq}/{hk}-p{page}" + (f"-{kv_dtype}" if kv_dtype else "")


def assert_build(wrapper, build: dict, what: str) -> None:
    variant = wrapper.kernel_build
    got = {name: getattr(variant, name) for name in build}
    assert got == build, f"{what}: ran {variant.name}"


@pytest.mark.parametrize("row", TABLE, ids=case_id)
def test_each_knob_runs_its_build_and_matches_the_reference(row):
    knob, dtype, d, hq, hk, page, kv_dtype = row
    rng = np.random.default_rng(zlib.crc32(case_id(row).encode()))
    pt, pages = scattered_page_table(LENS, page, rng)
    q = random_device_array((len(LENS), hq, d), dtype, rng)
    k, v = random_kv_caches((pages, page, hk, d), dtype, rng, kv_dtype)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt, kv_dtype=kv_dtype)

    def wrapper(experiments, **graph):
        return BatchDecodeWrapper(hq, hk, d, page, dtype, kv_dtype=kv_dtype,
                                  experiments=experiments, **graph)

    wrappers = [wrapper(knob.experiments)]
    if knob.graph_stable:
        # a capacity for the largest plan of the list (16 chunks a request): the default grid
        # of a small batch holds fewer
        wrappers.append(wrapper(knob.experiments, use_cuda_graph=True, max_batch_size=len(LENS),
                                max_num_pages=pt.kv_indices.size,
                                max_chunks=len(LENS) * max(n for _, n in PLANS)))
    baseline = wrapper(knob.baseline) if knob.baseline is not None else None
    for w in wrappers:
        for strategy, n in PLANS:
            what = f"{strategy}/{n}" + (" graph-stable" if w.use_cuda_graph else "")
            if baseline is not None:
                o, lse = plan_and_run_both(baseline, w, pt, q, k, v, what, strategy=strategy,
                                           num_splits=n)
            else:
                o, lse = plan_and_run(w, pt, q, k, v, strategy=strategy, num_splits=n)
            assert_build(w, knob.build, what)
            assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, what)


# ---- each knob's other paths ----------------------------------------------------------------

@pytest.mark.parametrize("row", [r for r in TABLE if r[0] is Q_SMEM], ids=case_id)
def test_q_in_shared_memory_under_multi_token_rows_and_the_unified_max(row):
    """Multi-token rows and the unified max's second pass (phi far below the scores: every CTA
    streams again) read the fragments back too."""
    _, dtype, d, hq, hk, page, kv_dtype = row
    rng = np.random.default_rng(zlib.crc32(case_id(row).encode()))
    pt, pages = scattered_page_table([2000, 9, 0, 700], page, rng)
    k, v = random_kv_caches((pages, page, hk, d), dtype, rng, kv_dtype)
    plain, smem = (BatchDecodeWrapper(hq, hk, d, page, dtype, kv_dtype=kv_dtype, experiments=e)
                   for e in (Q_SMEM.baseline, Q_SMEM.experiments))
    q = random_device_array((4, hq, d), dtype, rng)
    qm = random_device_array((7, hq, d), dtype, rng)
    for qx, extra in ((qm, {"qo_indptr": np.array([0, 3, 4, 5, 7])}), (q, {"unified_max": -60.0})):
        plan_and_run_both(plain, smem, pt, qx, k, v, str(extra), **extra)
        assert smem.kernel_build.q_in_smem == 1
    assert smem.unified_max_fallbacks() > 0


def test_q_in_shared_memory_under_the_cluster_merge():
    """The cluster build's epilogue reuses shared memory over the q region once q is dead:
    equal-length requests so that fused plans of 2 and 4 chunks merge in clusters."""
    from splitkv.runtime import device_info

    if int(device_info()["cc"]) < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    rng = np.random.default_rng(3)
    hq, hk, d = 16, 8, 256
    plain, smem = (BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", experiments=e)
                   for e in (Q_SMEM.baseline, Q_SMEM.experiments))
    pt, pages = scattered_page_table([900, 900], 16, rng)
    q = random_device_array((2, hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng)
    problem = DecodeProblem.from_page_table(pt, hq, hk, d)
    for n in (2, 4):
        plan = plan_from_chunk_counts(problem, [n, n], "fused")
        plan_and_run_both(plain, smem, pt, q, k, v, f"cluster {n}", plan=plan)
        assert smem.cluster_size == n and smem.kernel_build.q_in_smem == 1


@pytest.mark.parametrize("knob, hq, hk, d, field_name, cap_and_sinks", [
    (TILE_32, 32, 8, 64, "tile_tokens", False), (DIM_SPLIT, 16, 8, 256, "dim_split", True)],
    ids=["tile_per_warp_32", "dim_split_2"])
def test_tiles_and_the_dim_split_under_clusters_graphs_and_the_variants(knob, hq, hk, d,
                                                                         field_name, cap_and_sinks):
    """Clusters, a graph-stable wrapper planned on the host and on the device (whose records
    count the tile's pages), then multi-token rows under a window (the dim split with sinks and
    the soft cap too)."""
    want = {field_name: knob.build[field_name]}
    rng = np.random.default_rng(d)
    pt, q, k, v, w = assert_paths_match_reference(
        knob.experiments, hq, hk, d, rng, lambda g: assert_build(g, want, "graph-stable"))
    qo_indptr = np.array([0, 3, 5])
    qm = random_device_array((5, hq, d), "bfloat16", rng)
    if not cap_and_sinks:
        o, lse = plan_and_run(w, pt, qm, k, v, qo_indptr=qo_indptr, window_left=300)
        ref_o, ref_lse = reference_decode(qm.get(), k, v, pt, qo_indptr=qo_indptr,
                                          window_left=300)
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, "multi-token, window")
        return
    sinks = rng.standard_normal(hq).astype(np.float32)
    w.plan(pt, qo_indptr=qo_indptr, window_left=300, logits_soft_cap=20.0, strategy="fused",
           num_splits=3)
    out = cupy.full(qm.shape, 0xFFFF, cupy.uint16)
    lse = cupy.full(qm.shape[:2], np.nan, cupy.float32)
    w.run(qm, cupy.asarray(k), cupy.asarray(v), out=out, lse=lse, sinks=cupy.asarray(sinks))
    ref_o, ref_lse = reference_decode(qm.get(), k, v, pt, qo_indptr=qo_indptr, window_left=300,
                                      logits_soft_cap=20.0, sinks=sinks.astype(np.float64))
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2,
                             "multi-token, window, sinks, cap")


def test_more_ctas_a_kv_head_under_multi_token_rows():
    rng = np.random.default_rng(80)
    hq, hk, d = 64, 2, 128
    pt, pages = scattered_page_table([1800, 33, 0, 900], 16, rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng)
    w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", experiments=rows(16).experiments)
    qo_indptr = np.array([0, 2, 3, 4, 6])
    qm = random_device_array((6, hq, d), "bfloat16", rng)
    out, lse = plan_and_run(w, pt, qm, k, v, qo_indptr=qo_indptr, strategy="fused", num_splits=3)
    assert w.kernel_build.rows == 16
    ref_o, ref_lse = reference_decode(qm.get(), k, v, pt, qo_indptr=qo_indptr)
    assert_matches_reference(to_float64(out), lse, ref_o, ref_lse, 1e-2, "rows, multi-token")


# ---- the compact merge: a merge grid of the split requests only ------------------------------

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
    threads = compact.kernel_build.threads
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
