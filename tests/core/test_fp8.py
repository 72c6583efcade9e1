"""fp8 KV caches on the host: the formats' values, quantisation, and the float64 reference and
CPU executor over fp8 caches with per-tensor and per-kv-head scales (exact dequantisation)."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import execute_plan_cpu, plan_fixed_splits, reference_decode
from splitkv.core import fp8

from helpers.batches import build_batch

FORMATS = fp8.FP8_FORMATS


def test_e5m2_values_are_the_top_byte_of_float16():
    """e5m2 is float16 with the low byte dropped: an independent check of every code."""
    codes = np.arange(256, dtype=np.uint16)
    as_half = (codes << 8).view(np.float16).astype(np.float64)
    np.testing.assert_array_equal(fp8.decode_table("float8_e5m2"), as_half)


def test_e4m3fn_values_from_the_spec():
    t = fp8.decode_table("float8_e4m3fn")
    assert t[0x38] == 1.0 and t[0x7E] == 448.0 and t[0xFE] == -448.0
    assert t[0x08] == 2.0 ** -6 and t[0x01] == 2.0 ** -9 and t[0x00] == 0.0
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF]) and np.sum(np.isnan(t)) == 2
    assert not np.any(np.isinf(t))
    assert fp8.max_finite("float8_e4m3fn") == 448.0 and fp8.max_finite("float8_e5m2") == 57344.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trips_every_finite_code_and_rounds_ties_to_even(fmt):
    t = fp8.decode_table(fmt)
    finite = [c for c in range(256) if np.isfinite(t[c]) and c != 0x80]    # -0 -> code 0
    np.testing.assert_array_equal(fp8.quantize(t[finite], fmt), finite)
    # the midpoint between codes 0x38 (1.0) and 0x39 goes to the even one, 0x38
    mid = (t[0x38] + t[0x39]) / 2
    assert fp8.quantize([mid], fmt)[0] == 0x38
    assert fp8.quantize([(t[0x39] + t[0x3A]) / 2], fmt)[0] == 0x3A
    assert np.isnan(t[fp8.quantize([np.nan], fmt)[0]])
    with pytest.raises(ValueError, match="largest finite"):
        fp8.quantize([fp8.max_finite(fmt) * 2], fmt)
    np.testing.assert_array_equal(fp8.quantize([4.0], fmt, scale=2.0), fp8.quantize([2.0], fmt))


def fp8_batch(rng, fmt, kv_lens=(37, 0, 300, 129), num_kv_heads=2):
    """A paged batch with K/V as random finite fp8 codes (values within a few units)."""
    b = build_batch(rng, kv_lens, num_qo_heads=8, num_kv_heads=num_kv_heads, head_dim=64)
    k = fp8.quantize(np.clip(b.k_cache, -8, 8), fmt)
    v = fp8.quantize(np.clip(b.v_cache, -8, 8), fmt)
    return b, k, v


SCALES = {"none": (None, None), "tensor": (0.37, 1.9), "per head": ([0.5, 2.0], [3.0, 0.25])}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scales", SCALES, ids=str)
def test_reference_over_fp8_is_the_reference_over_its_exact_values(rng, fmt, scales):
    b, k, v = fp8_batch(rng, fmt)
    k_scale, v_scale = SCALES[scales]
    out, lse = reference_decode(b.q, k, v, b.page_table, kv_dtype=fmt, k_scale=k_scale,
                                v_scale=v_scale)
    ks = np.ones(2) if k_scale is None else np.broadcast_to(np.asarray(k_scale, float), (2,))
    vs = np.ones(2) if v_scale is None else np.broadcast_to(np.asarray(v_scale, float), (2,))
    k64 = fp8.decode_table(fmt)[k] * ks[:, None]
    v64 = fp8.decode_table(fmt)[v] * vs[:, None]
    want_o, want_lse = reference_decode(b.q, k64, v64, b.page_table)
    np.testing.assert_array_equal(out, want_o)
    np.testing.assert_array_equal(lse, want_lse)
    # the same scales through the float path: K = stored x k_scale for any dtype
    again = reference_decode(b.q, fp8.decode_table(fmt)[k], fp8.decode_table(fmt)[v],
                             b.page_table, k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_array_equal(again[0], want_o)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 3), ("fused", 4)])
def test_cpu_executor_over_fp8_matches_the_reference(rng, fmt, strategy, splits):
    b, k, v = fp8_batch(rng, fmt, kv_lens=(37, 300, 129, 64))
    plan = plan_fixed_splits(b.problem, splits, strategy)
    kw = dict(kv_dtype=fmt, k_scale=[0.5, 2.0], v_scale=1.5)
    out, lse = execute_plan_cpu(plan, b.q, k, v, b.page_table, **kw)
    want_o, want_lse = reference_decode(b.q, k, v, b.page_table, **kw)
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_nan_code_in_k_makes_its_heads_nan_and_no_other(rng):
    fmt = "float8_e4m3fn"
    b, k, v = fp8_batch(rng, fmt, kv_lens=(40, 40))
    page = b.page_table.kv_indices[b.page_table.kv_indptr[1]]
    k[page, 3, 1, 5] = 0x7F                         # request 1, kv head 1
    out, lse = reference_decode(b.q, k, v, b.page_table, kv_dtype=fmt)
    assert np.all(np.isnan(lse[1, 4:])) and np.all(np.isfinite(lse[1, :4]))
    assert np.all(np.isfinite(lse[0])) and np.all(np.isfinite(out[0]))


def test_vllm_names_are_accepted():
    assert fp8.fp8_format("kv_dtype", "fp8_e4m3") == "float8_e4m3fn"
    assert fp8.fp8_format("kv_dtype", "fp8") == "float8_e4m3fn"
    assert fp8.fp8_format("kv_dtype", "fp8_e5m2") == "float8_e5m2"
    assert fp8.fp8_format("kv_dtype", None) is None


def test_bad_fp8_inputs_are_named(rng):
    fmt = "float8_e4m3fn"
    b, k, v = fp8_batch(rng, fmt)
    with pytest.raises(TypeError, match="k_cache: dtype 'uint8'.*needs kv_dtype"):
        reference_decode(b.q, k, v, b.page_table)
    with pytest.raises(ValueError, match="kv_dtype: expected None or an fp8 format"):
        reference_decode(b.q, k, v, b.page_table, kv_dtype="int8")
    with pytest.raises(TypeError, match="v_cache: a float8_e4m3fn cache"):
        reference_decode(b.q, k, b.v_cache, b.page_table, kv_dtype=fmt)
    with pytest.raises(ValueError, match="k_scale: expected one value .* or 2"):
        reference_decode(b.q, k, v, b.page_table, kv_dtype=fmt, k_scale=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="v_scale: expected finite values > 0"):
        reference_decode(b.q, k, v, b.page_table, kv_dtype=fmt, v_scale=float("nan"))
    with pytest.raises(ValueError, match="k_scale: expected finite values > 0"):
        reference_decode(b.q, k, v, b.page_table, kv_dtype=fmt, k_scale=-1.0)
    with pytest.raises(TypeError, match="k_scale: expected a number"):
        reference_decode(b.q, k, v, b.page_table, kv_dtype=fmt, k_scale="1.0")
    plan = plan_fixed_splits(b.problem, 2, "split_merge")
    with pytest.raises(TypeError, match="needs kv_dtype"):
        execute_plan_cpu(plan, b.q, k, v, b.page_table)


@pytest.mark.parametrize("fmt, scale, error, named", [
    (None, 1.0, ValueError, "fmt: expected an fp8 format"),
    ("float8_e4m3fn", 0, ValueError, "scale: expected a positive finite number, got 0"),
    ("float8_e4m3fn", -2.0, ValueError, "scale: expected a positive finite number"),
    ("float8_e4m3fn", float("inf"), ValueError, "scale: expected a positive finite number"),
    ("float8_e4m3fn", True, ValueError, "scale: expected a positive finite number"),
    (7, 1.0, TypeError, "fmt: expected None, a format name or a dtype, got int"),
])
def test_quantize_names_a_bad_format_or_scale(fmt, scale, error, named):
    """Not a KeyError, not inf blamed on values, not a sign flipped by a negative scale."""
    with pytest.raises(error, match=named):
        fp8.quantize(np.ones(3), fmt, scale)
