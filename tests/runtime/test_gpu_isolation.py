"""Isolation of non-finite inputs on the GPU, the host paths' rule (docs/RELIABILITY.md): a NaN
or Inf in one request's q or K makes that (request, query head) NaN, output and LSE, on every
strategy (the fused, cluster and graph-stable merges too); NaN or Inf in V reaches only the
output components it is summed into; every other request and head keeps its bits."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv.measure.test_data import random_device_array, scattered_page_table
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

HQ, HK, D = 32, 8, 128
GROUP = HQ // HK
LENS = [700, 3000, 0, 1500]
HIT, KVH, DIM = 1, 3, 5               # request 1, kv head 3 (query heads 12..15), dim 5
BF16 = {"nan": 0x7FC0, "+inf": 0x7F80, "-inf": 0xFF80, "one": 0x3F80}
PLANS = [("single", 1, False), ("split_merge", 4, False), ("fused", 4, False),
         ("fused", 2, False), ("fused", 4, True), ("split_merge", 4, True)]


def wrapper(pt, graph_stable):
    kw = dict(use_cuda_graph=True, max_batch_size=len(LENS),
              max_num_pages=pt.kv_indices.size) if graph_stable else {}
    return BatchDecodeWrapper(HQ, HK, D, 16, "bfloat16", **kw)


def run(w, pt, q, k, v, strategy, n):
    w.plan(pt, num_splits=n, strategy=strategy)
    out = cupy.full(q.shape, 0xFFFF, cupy.uint16)
    lse = cupy.full(q.shape[:2], np.nan, cupy.float32)
    w.run(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out, lse=lse)
    return out.get(), lse.get()


def bf16_nan(bits):
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(51)
    pt, pages = scattered_page_table(LENS, 16, rng)
    q = random_device_array((len(LENS), HQ, D), "bfloat16", rng).get()
    k, v = (random_device_array((pages, 16, HK, D), "bfloat16", rng).get() for _ in range(2))
    token = pt.kv_indices[pt.kv_indptr[HIT] + 7], 3          # a token of the hit request
    return pt, q, k, v, token


@pytest.mark.parametrize("where", ["q nan", "q +inf", "k nan", "k +inf", "k -inf"])
@pytest.mark.parametrize("strategy,n,graph_stable", PLANS)
def test_a_bad_q_or_k_makes_its_heads_nan_and_nothing_else(data, where, strategy, n,
                                                           graph_stable):
    pt, q, k, v, (page, slot) = data
    w = wrapper(pt, graph_stable)
    q2, k2 = q.copy(), k.copy()
    heads = slice(KVH * GROUP, (KVH + 1) * GROUP)
    tensor, value = where.split()
    if tensor == "q":
        q2[HIT, KVH * GROUP + 1, DIM] = BF16[value]                 # one query head
        hit = [KVH * GROUP + 1]
    else:
        q2[HIT, heads, DIM] = BF16["one"]          # q.k's sign is the bad value's: +-inf
        k2[page, slot, KVH, DIM] = BF16[value]
        hit = list(range(KVH * GROUP, (KVH + 1) * GROUP))
    clean_o, clean_lse = run(w, pt, q2 if tensor == "k" else q, k, v, strategy, n)
    o, lse = run(w, pt, q2, k2, v, strategy, n)
    mask = np.zeros(o.shape[:2], bool)
    mask[HIT, hit] = True
    assert bf16_nan(o[mask]).all() and np.isnan(lse[mask]).all(), (where, strategy, n)
    np.testing.assert_array_equal(o[~mask], clean_o[~mask])
    np.testing.assert_array_equal(lse[~mask].view(np.uint32), clean_lse[~mask].view(np.uint32))


@pytest.mark.parametrize("value", ["nan", "+inf"])
@pytest.mark.parametrize("strategy,n,graph_stable", PLANS)
def test_a_bad_v_reaches_its_components_only(data, value, strategy, n, graph_stable):
    pt, q, k, v, (page, slot) = data
    w = wrapper(pt, graph_stable)
    clean_o, clean_lse = run(w, pt, q, k, v, strategy, n)
    v2 = v.copy()
    v2[page, slot, KVH, DIM] = BF16[value]
    o, lse = run(w, pt, q, k, v2, strategy, n)
    heads = list(range(KVH * GROUP, (KVH + 1) * GROUP))
    component = np.zeros(o.shape, bool)
    component[HIT, heads, DIM] = True
    hit = o[component]
    assert (bf16_nan(hit) if value == "nan" else (hit & 0x7FFF) >= 0x7F80).all(), strategy
    np.testing.assert_array_equal(o[~component], clean_o[~component])
    np.testing.assert_array_equal(lse.view(np.uint32), clean_lse.view(np.uint32))
