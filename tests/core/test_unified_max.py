"""The unified max's host side (``core.unified_max``): phi's checks, the band each MMA type
allows, the choice of phi from row maxima, and the prediction of which (chunk, kv head) items
fall back, on realistic and adversarial inputs. The GPU kernels' behaviour against these is
tests/kernels/test_gpu_unified_max.py."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import DecodeProblem, plan_fixed_splits
from splitkv.core import fp8
from splitkv.core import unified_max as UM
from splitkv.testing import scattered_page_table

LN2 = np.log(2)


@pytest.mark.parametrize("bad,kind", [(True, TypeError), ("1.0", TypeError), ([1.0], TypeError),
                                      (float("nan"), ValueError), (float("inf"), ValueError),
                                      (1e5, ValueError)])
def test_a_bad_phi_is_refused_by_name(bad, kind):
    with pytest.raises(kind, match="^unified_max: "):
        UM.check_unified_max(bad)


def test_phi_is_a_number_or_none():
    assert UM.check_unified_max(None) is None
    assert UM.check_unified_max(3) == 3.0 and UM.check_unified_max(np.float32(-2.5)) == -2.5


def test_the_band_follows_the_type_p_is_packed_in():
    # bfloat16 P has float's range; float16 P (float16 q, or fp8 K/V's float16 MMAs) does not
    assert UM.band_log2("bfloat16") == (60, 15)
    assert UM.band_log2("float16") == (3, 15)
    assert UM.band_log2("bfloat16", "float8_e4m3fn") == (3, 15)
    lo, hi = UM.band("bfloat16")
    assert lo == pytest.approx(-60 * LN2) and hi == pytest.approx(15 * LN2)


def test_in_band_at_its_edges_and_for_rows_without_tokens():
    phi = 5.0
    lo, hi = UM.band("float16")
    maxima = np.array([phi + hi - 1e-3, phi + hi + 1e-3, phi + lo + 1e-3, phi + lo - 1e-3,
                       -np.inf, np.inf, np.nan])
    assert UM.in_band(maxima, phi, "float16").tolist() == [True, False, True, False, True,
                                                           False, False]


def test_choose_phi_puts_the_maxima_in_band():
    rng = np.random.default_rng(0)
    maxima = rng.normal(12.0, 1.5, 10_000)
    for dtype in ("bfloat16", "float16"):
        phi = UM.choose_unified_max(maxima, dtype)
        assert UM.in_band(maxima, phi, dtype).mean() > 0.99
    # the span's middle at the band's: maxima from -50 to 50 around phi's band middle
    wide = np.concatenate([np.full(100, -50.0), np.full(100, 50.0)])
    phi = UM.choose_unified_max(wide, "float16")
    assert phi == pytest.approx(0 - sum(UM.band("float16")) / 2)
    assert not UM.in_band(wide, phi, "float16").any()        # wider than float16's band
    assert UM.in_band(wide / 2, UM.choose_unified_max(wide / 2, "bfloat16"), "bfloat16").all()
    with pytest.raises(ValueError, match="row_maxima"):
        UM.choose_unified_max([np.nan, -np.inf], "bfloat16")


def case(rng, lens=(700, 300, 40), hq=8, hk=2, d=64, splits=3):
    pt, pages = scattered_page_table(list(lens), 16, rng)
    q = rng.standard_normal((len(lens), hq, d))
    k = rng.standard_normal((pages, 16, hk, d))
    v = rng.standard_normal((pages, 16, hk, d))
    plan = plan_fixed_splits(DecodeProblem.from_page_table(pt, hq, hk, d), splits)
    return pt, plan, q, k, v


def test_realistic_scores_do_not_fall_back_and_adversarial_ones_do():
    rng = np.random.default_rng(1)
    pt, plan, q, k, v = case(rng)
    maxima = UM.row_maxima(plan, q, k, pt)
    assert maxima.shape == (plan.num_chunks, 8) and np.isfinite(maxima).all()
    phi = UM.choose_unified_max(maxima, "float16")
    items = UM.fallback_items(plan, q, k, v, pt, phi, "float16")
    assert items.shape == (plan.num_chunks, 2) and not items.any()
    # phi far above every score: all below the band (float16), not for bfloat16's wider band
    # (phi sits 15.6 above the maxima there, 4.2 below them for float16)
    assert UM.fallback_items(plan, q, k, v, pt, phi + 20, "float16").all()
    assert not UM.fallback_items(plan, q, k, v, pt, phi + 20, "bfloat16").any()
    # phi far below: every row above the band, whatever the type
    assert UM.fallback_items(plan, q, k, v, pt, phi - 40, "bfloat16").all()
    # one huge score: request 0's kv head 1, token 5 (its first chunk) only
    spiked = k.copy()
    slot = pt.token_slots(0)[5]
    spiked.reshape(-1, 2, 64)[slot, 1] = q[0, 4] * 40
    items = UM.fallback_items(plan, q, spiked, v, pt, phi, "bfloat16")
    first = int(np.flatnonzero(plan.chunk_request == 0)[0])
    assert items[first, 1] and items.sum() == 1
    # all scores equal (K the same row everywhere): each maximum is that one score
    k0 = k.reshape(-1, 2, 64)[0]
    flat = np.broadcast_to(k0, k.shape).copy()
    m = UM.row_maxima(plan, q, flat, pt)
    for c in range(plan.num_chunks):
        b = plan.chunk_request[c]
        want = [q[b, h] @ k0[h // 4] / 8 for h in range(8)]
        assert np.allclose(m[c], want) if plan.chunk_end[c] > plan.chunk_start[c] else \
            np.isneginf(m[c]).all()


def test_non_finite_inputs_fall_back_where_they_are():
    rng = np.random.default_rng(2)
    pt, plan, q, k, v = case(rng)
    phi = UM.choose_unified_max(UM.row_maxima(plan, q, k, pt), "bfloat16")
    bad_v = v.copy()
    bad_v.reshape(-1, 2, 64)[pt.token_slots(1)[0], 0, 3] = np.inf
    items = UM.fallback_items(plan, q, k, bad_v, pt, phi, "bfloat16")
    first = int(np.flatnonzero(plan.chunk_request == 1)[0])
    assert items[first, 0] and items.sum() == 1
    bad_q = q.copy()
    bad_q[2, 0, 0] = np.nan
    items = UM.fallback_items(plan, bad_q, k, v, pt, phi, "bfloat16")
    assert items[plan.chunk_request == 2, 0].all() and items.sum() == (plan.chunk_request == 2).sum()
    assert np.isnan(UM.row_maxima(plan, bad_q, k, pt)[plan.chunk_request == 2, 0]).all()


def test_fp8_caches_are_read_as_their_values():
    rng = np.random.default_rng(3)
    pt, plan, q, k, v = case(rng)
    k8 = fp8.quantize(k, "float8_e4m3fn")
    m8 = UM.row_maxima(plan, q, k8, pt, kv_dtype="float8_e4m3fn", k_scale=0.5)
    ref = UM.row_maxima(plan, q, fp8.dequantize(k8, "float8_e4m3fn") * 0.5, pt)
    assert np.allclose(m8, ref)


def test_the_host_side_checks_its_inputs_and_reads_hnd_caches():
    rng = np.random.default_rng(4)
    pt, plan, q, k, v = case(rng)
    hnd = np.ascontiguousarray(k.transpose(0, 2, 1, 3))      # [pages, kv heads, page, dim]
    np.testing.assert_array_equal(UM.row_maxima(plan, q, hnd, pt, kv_layout="HND"),
                                  UM.row_maxima(plan, q, k, pt))
    with pytest.raises(ValueError, match="^q"):
        UM.row_maxima(plan, q[:, :4], k, pt)
    with pytest.raises(TypeError, match="^plan"):
        UM.row_maxima("plan", q, k, pt)
    with pytest.raises(ValueError, match="^logits_soft_cap"):
        UM.row_maxima(plan, q, k, pt, logits_soft_cap=-1.0)
    with pytest.raises(TypeError, match="^phi: expected a number"):
        UM.fallback_items(plan, q, k, v, pt, None, "bfloat16")
    with pytest.raises(TypeError, match="^phi: expected a number"):
        UM.fallback_items(plan, q, k, v, pt, "2", "bfloat16")


def test_the_band_checks_its_dtypes():
    with pytest.raises((TypeError, ValueError), match="^dtype"):
        UM.band("float32")
    with pytest.raises((TypeError, ValueError), match="^kv_dtype"):
        UM.band("bfloat16", "int8")
    assert UM.band_log2("bfloat16", "fp8_e4m3") == (3, 15) and UM.band_log2("fp16") == (3, 15)


@pytest.mark.parametrize("quantile", [-0.1, 0.5, 2, float("nan"), "0.1", True])
def test_a_bad_quantile_is_named(quantile):
    with pytest.raises(ValueError, match="quantile: expected a number in \\[0, 0.5\\)"):
        UM.choose_unified_max(np.linspace(-3, 3, 50), "bfloat16", quantile=quantile)
