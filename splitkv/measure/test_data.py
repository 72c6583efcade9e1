"""Random decode batches on the GPU and the checks the GPU tests make with them: pages
scattered at random through a pool (``splitkv.testing``), fresh random values each time,
outputs poisoned so that a row left unwritten shows, a wrapper's output against the float64
reference. Shared by the GPU tests, the benchmarks and the examples; the CuPy calls are the
runtime's (``runtime.cupy_arrays``)."""

from __future__ import annotations

import numpy as np

from ..core.bfloat16 import float32_to_bits
from ..runtime.cupy_arrays import full, to_device
from ..testing import scattered_page_table

__all__ = ["assert_matches_reference", "assert_paths_match_reference", "float_to_bits",
           "plan_and_run", "plan_and_run_both", "poisoned_output", "random_device_array",
           "random_kv_caches", "scattered_page_table"]


def float_to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Host float array -> 16-bit storage: float16 array, or bfloat16 bits as uint16
    (round to nearest even)."""
    if dtype == "float16":
        return x.astype(np.float16)
    return float32_to_bits(x)


def random_device_array(shape, dtype: str, rng: np.random.Generator, scale: float = 1.0):
    """A CuPy array of random normal values in 16-bit storage (bfloat16 as uint16 bits)."""
    host = float_to_bits(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)
    return to_device(host)


def random_kv_caches(shape, dtype: str, rng: np.random.Generator, kv_dtype=None):
    """Host K and V caches of ``shape`` for the GPU tests: random normal values in 16-bit
    storage, or with ``kv_dtype`` fp8 codes of N(0, 2) values clipped to +-12."""
    if kv_dtype:
        from ..core import fp8

        return tuple(fp8.quantize(np.clip(rng.standard_normal(shape) * 2, -12, 12), kv_dtype)
                     for _ in range(2))
    return tuple(random_device_array(shape, dtype, rng).get() for _ in range(2))


def poisoned_output(q):
    """A device output shaped like q, filled with NaN in q's storage (bfloat16 bits as uint16,
    or float16): a row the kernels leave unwritten shows as NaN."""
    if q.dtype == np.float16:
        return full(q.shape, np.nan, np.float16)
    return full(q.shape, 0xFFFF, np.uint16)


def plan_and_run(wrapper, page_table, q, k_cache, v_cache, **plan_kw):
    """``wrapper.plan(page_table, **plan_kw)`` then one run into poisoned outputs; returns
    (out, lse) on the host."""
    wrapper.plan(page_table, **plan_kw)
    out = poisoned_output(q)
    lse = full(q.shape[:2], np.nan, np.float32)
    wrapper.run(q, to_device(k_cache), to_device(v_cache), out=out, lse=lse)
    return out.get(), lse.get()


def plan_and_run_both(first, second, page_table, q, k_cache, v_cache, what="", **plan_kw):
    """``plan_and_run`` with two wrappers (builds that must agree, e.g. an experiment and the
    build it replaces) on the same plan: their outputs and LSEs are the same bits. Returns the
    second's (out, lse)."""
    o1, l1 = plan_and_run(first, page_table, q, k_cache, v_cache, **plan_kw)
    o2, l2 = plan_and_run(second, page_table, q, k_cache, v_cache, **plan_kw)
    assert np.array_equal(o1.view(np.uint16), o2.view(np.uint16)), f"outputs differ ({what})"
    assert np.array_equal(l1.view(np.uint32), l2.view(np.uint32)), f"LSEs differ ({what})"
    return o2, l2


def assert_paths_match_reference(experiments, num_qo_heads: int, num_kv_heads: int,
                                 head_dim: int, rng: np.random.Generator, check=None):
    """An experiment's build against the float64 reference on the paths besides per-shape
    plans: fused plans of 2 and 4 chunks merged in clusters (sm_90+), a graph-stable wrapper
    planned on the host (single, split_merge, fused) and one planned on the device.
    ``check(wrapper)`` asserts which build ran. Two bf16 requests of 900 tokens; returns
    (page_table, q, k, v, the per-shape wrapper) for the caller's own cases."""
    from ..core.plan import plan_from_chunk_counts
    from ..core.problem import DecodeProblem
    from ..core.reference import reference_decode, to_float64
    from ..runtime import device_info
    from ..runtime.wrapper import BatchDecodeWrapper

    hq, hk, d = num_qo_heads, num_kv_heads, head_dim
    pt, pages = scattered_page_table([900, 900], 16, rng)
    q = random_device_array((2, hq, d), "bfloat16", rng)
    k, v = random_kv_caches((pages, 16, hk, d), "bfloat16", rng)
    ref_o, ref_lse = reference_decode(q.get(), k, v, pt)
    w = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", experiments=experiments)
    if int(device_info()["cc"]) >= 90:
        problem = DecodeProblem.from_page_table(pt, hq, hk, d)
        for n in (2, 4):
            o, lse = plan_and_run(w, pt, q, k, v, plan=plan_from_chunk_counts(problem, [n, n],
                                                                              "fused"))
            assert w.cluster_size == n
            assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, f"cluster {n}")
    graph = dict(experiments=experiments, use_cuda_graph=True, max_batch_size=2,
                 max_num_pages=pt.kv_indices.size)
    g = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", **graph)
    for strategy, n in (("single", 1), ("split_merge", 3), ("fused", 4)):
        o, lse = plan_and_run(g, pt, q, k, v, strategy=strategy, num_splits=n)
        if check:
            check(g)
        assert_matches_reference(to_float64(o), lse, ref_o, ref_lse, 1e-2, f"graph {strategy}")
    on_device = BatchDecodeWrapper(hq, hk, d, 16, "bfloat16", **graph)
    on_device.plan_on_device(**{name: to_device(np.asarray(getattr(pt, name), dtype=np.int32))
                                for name in ("kv_indptr", "kv_indices", "kv_last_page_len")})
    out = poisoned_output(q)
    lse = full(q.shape[:2], np.nan, np.float32)
    on_device.run(q, to_device(k), to_device(v), out=out, lse=lse)
    if check:
        check(on_device)
    assert_matches_reference(to_float64(out.get()), lse.get(), ref_o, ref_lse, 1e-2,
                             "planned on the device")
    return pt, q, k, v, w


def assert_matches_reference(o: np.ndarray, lse: np.ndarray, ref_o: np.ndarray,
                             ref_lse: np.ndarray, tol: float, what: str = "") -> float:
    """A GPU decode's output and LSE (on the host, float64 output) against the float64
    reference: no NaN where the reference has none (a poisoned, unwritten output shows), the
    relative L2 error under ``tol``, and the LSE finite exactly where the reference's is and
    close there. Returns the relative error."""
    assert np.array_equal(np.isnan(o), np.isnan(ref_o)), f"NaN or unwritten outputs ({what})"
    ok = ~np.isnan(ref_o)
    err = float(np.linalg.norm(o[ok] - ref_o[ok]) / max(np.linalg.norm(ref_o[ok]), 1e-30))
    assert err < tol, f"rel err {err:.2e} ({what})"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"LSE finite where it should not be ({what})"
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3, err_msg=what)
    return err
