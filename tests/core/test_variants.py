"""Attention variants on the host paths (``core/variants.py``): sliding window, logits soft cap,
attention sinks and multi-token decode, alone and combined (with fp8 KV too), in the float64
reference against a computation written out here, and in the CPU executor on every strategy
against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import execute_plan_cpu, plan_fixed_splits, reference_decode
from splitkv.core import fp8

from helpers.batches import build_batch

HQ, HK, D = 8, 2, 64


def explicit(b, q, k, v, table, *, window_left=-1, cap=None, sinks=None, qo_indptr=None):
    """Request b's rows, head by head, from the definitions (core/variants.py)."""
    kv_len = int(table.kv_lens[b])
    slots = table.token_slots(b)
    rows = [b] if qo_indptr is None else list(range(qo_indptr[b], qo_indptr[b + 1]))
    k_flat, v_flat = k.reshape(-1, HK, D), v.reshape(-1, HK, D)
    outs, lses = [], []
    for j, r in enumerate(rows):
        pos = kv_len - len(rows) + j
        lo = 0 if window_left < 0 else max(0, pos - window_left)
        seen = slots[lo:min(pos + 1, kv_len)] if kv_len else slots[:0]
        o_row, lse_row = np.zeros((HQ, D)), np.zeros(HQ)
        for h in range(HQ):
            kh = h // (HQ // HK)
            s = [float(q[r, h] @ k_flat[t, kh]) / np.sqrt(D) for t in seen]
            if cap is not None:
                s = [cap * np.tanh(x / cap) for x in s]
            weights = [np.exp(x) for x in s]
            denom = sum(weights) + (np.exp(sinks[h]) if sinks is not None else 0.0)
            o_row[h] = sum((w * v_flat[t, kh] for w, t in zip(weights, seen)), np.zeros(D))
            o_row[h] = o_row[h] / denom if denom > 0 else o_row[h]
            lse_row[h] = np.log(denom) if denom > 0 else -np.inf
        outs.append(o_row)
        lses.append(lse_row)
    return np.array(outs), np.array(lses)


def batch(rng, lens=(37, 0, 300, 129, 5)):
    return build_batch(rng, lens, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, q_scale=0.5)


CASES = {
    "window": dict(window_left=40),
    "window 0": dict(window_left=0),
    "soft cap": dict(logits_soft_cap=1.5),
    "sinks": dict(sinks=np.linspace(-2.0, 3.0, HQ)),
    "sinks with -inf": dict(sinks=np.array([-np.inf, 0.5] * (HQ // 2))),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_follows_the_definition(rng, case):
    b = batch(rng)
    kw = CASES[case]
    out, lse = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table, **kw)
    for r in range(b.page_table.batch_size):
        o, l = explicit(r, b.q, b.k_cache, b.v_cache, b.page_table, cap=kw.get("logits_soft_cap"),
                        window_left=kw.get("window_left", -1), sinks=kw.get("sinks"))
        np.testing.assert_allclose(out[r], o[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[r], l[0], rtol=1e-10, atol=1e-12)


def ragged_rows(rng, lens):
    q_lens = [min(max(int(n), 1), int(rng.integers(1, 6))) for n in lens]
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)


def test_multi_token_decode_is_causal_among_the_new_tokens(rng):
    b = batch(rng)
    qo_indptr = ragged_rows(rng, b.page_table.kv_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), HQ, D)) * 0.5
    out, lse = reference_decode(q, b.k_cache, b.v_cache, b.page_table, qo_indptr=qo_indptr)
    assert out.shape == (qo_indptr[-1], HQ, D)
    for r in range(b.page_table.batch_size):
        o, l = explicit(r, q, b.k_cache, b.v_cache, b.page_table, qo_indptr=qo_indptr)
        rows = slice(qo_indptr[r], qo_indptr[r + 1])
        np.testing.assert_allclose(out[rows], o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[rows], l, rtol=1e-10, atol=1e-12)
    # one row per request through qo_indptr: the plain path's bits
    plain = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table)
    again = reference_decode(b.q, b.k_cache, b.v_cache, b.page_table,
                             qo_indptr=np.arange(b.page_table.batch_size + 1))
    np.testing.assert_array_equal(plain[0], again[0])
    np.testing.assert_array_equal(plain[1], again[1])


@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 7)])
@pytest.mark.parametrize("fp8_kv", [False, True], ids=["bf16-values", "fp8"])
def test_executor_matches_the_reference_with_everything_combined(rng, strategy, splits, fp8_kv):
    """Window + soft cap + sinks + ragged multi-token (and fp8 KV): every strategy's chunks,
    some cut off by the window or the causal mask, merge to the reference."""
    b = batch(rng, lens=(300, 1, 129, 64, 700))
    qo_indptr = ragged_rows(rng, b.page_table.kv_lens)
    q = rng.standard_normal((int(qo_indptr[-1]), HQ, D)) * 0.5
    k, v = b.k_cache, b.v_cache
    kw = dict(window_left=50, logits_soft_cap=2.0, sinks=np.linspace(-1, 1, HQ),
              qo_indptr=qo_indptr)
    if fp8_kv:
        k, v = fp8.quantize(np.clip(k, -8, 8), "fp8_e4m3"), fp8.quantize(np.clip(v, -8, 8), "fp8")
        kw.update(kv_dtype="fp8_e4m3", k_scale=[0.5, 1.5], v_scale=2.0)
    plan = plan_fixed_splits(b.problem, splits, strategy)
    out, lse = execute_plan_cpu(plan, q, k, v, b.page_table, **kw)
    want_o, want_lse = reference_decode(q, k, v, b.page_table, **kw)
    np.testing.assert_allclose(out, want_o, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-11, atol=1e-12)


def test_plain_calls_keep_their_bits(rng):
    """No variant: the executor's and the reference's bits of before (window -1, no cap)."""
    b = batch(rng)
    plan = plan_fixed_splits(b.problem, 3, "split_merge")
    plain = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table)
    again = execute_plan_cpu(plan, b.q, b.k_cache, b.v_cache, b.page_table, window_left=-1,
                             logits_soft_cap=0, sinks=None)
    np.testing.assert_array_equal(plain[0], again[0])
    np.testing.assert_array_equal(plain[1], again[1])


def test_a_nan_in_k_is_nan_even_under_a_soft_cap(rng):
    b = batch(rng, lens=(40, 40))
    k = b.k_cache.copy()
    k[b.page_table.kv_indices[0], 3, 1, 0] = np.inf          # request 0, kv head 1
    out, lse = reference_decode(b.q, k, b.v_cache, b.page_table, logits_soft_cap=1.0,
                                sinks=np.zeros(HQ))
    assert np.all(np.isnan(lse[0, 4:])) and np.all(np.isfinite(lse[0, :4]))
    assert np.all(np.isfinite(lse[1]))


def test_bad_variant_arguments_are_named(rng):
    b = batch(rng)
    args = (b.q, b.k_cache, b.v_cache, b.page_table)
    with pytest.raises(ValueError, match="window_left"):
        reference_decode(*args, window_left=-2)
    with pytest.raises(TypeError, match="window_left"):
        reference_decode(*args, window_left=1.5)
    with pytest.raises(ValueError, match="logits_soft_cap: expected a finite value >= 0"):
        reference_decode(*args, logits_soft_cap=float("nan"))
    with pytest.raises(TypeError, match="logits_soft_cap"):
        reference_decode(*args, logits_soft_cap="2")
    with pytest.raises(ValueError, match=f"sinks: expected shape \\[{HQ}\\]"):
        reference_decode(*args, sinks=np.zeros(HK))
    with pytest.raises(ValueError, match="sinks: expected values that are not NaN"):
        reference_decode(*args, sinks=np.full(HQ, np.nan))
    n = b.page_table.batch_size
    with pytest.raises(ValueError, match=f"qo_indptr: expected {n + 1} elements"):
        reference_decode(*args, qo_indptr=np.arange(n))
    with pytest.raises(ValueError, match="qo_indptr: request 0 has 0 query rows"):
        reference_decode(*args, qo_indptr=np.array([0, 0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="request 4 has 6 query rows but 5 KV tokens"):
        reference_decode(*args, qo_indptr=np.array([0, 1, 2, 3, 4, 10]))
    with pytest.raises(ValueError, match="q: expected shape"):
        reference_decode(*args, qo_indptr=np.array([0, 2, 3, 4, 5, 6]))   # q has 5 rows, not 6
    plan = plan_fixed_splits(b.problem, 2, "fused")
    with pytest.raises(ValueError, match="sinks"):
        execute_plan_cpu(plan, *args, sinks=[1.0])


def test_a_kernel_variant_is_one_value_that_names_its_defines_and_tags():
    """A build's hooks: one frozen value whose fields give the kernel's defines (the name
    upper-cased, every hook, in order) and the build name's tags (the hooks compiled in)."""
    from splitkv.core.builds import Build
    from splitkv.core.variants import PLAIN, KernelVariant

    both = KernelVariant(soft_cap=True, unified_max=True)
    assert both.defines == {"SOFT_CAP": 1, "MULTI_TOKEN": 0, "UNIFIED_MAX": 1, "ALIBI": 0}
    assert both.tags == "_softcap_umax" and PLAIN.tags == ""
    same = KernelVariant(True, False, True, False)
    assert both == same and hash(both) == hash(same)
    assert set(KernelVariant.TAGS) == {name.lower() for name in PLAIN.defines}   # a tag a hook
    with pytest.raises(TypeError, match="soft_cap: expected True or False, got 1"):
        KernelVariant(soft_cap=1)
    with pytest.raises(TypeError, match="variant: expected a KernelVariant"):
        Build("bfloat16", 128, 1, variant=True)
    assert Build("bfloat16", 128, 1).variant is PLAIN
