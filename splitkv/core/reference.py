"""Exact decode attention in float64 NumPy: the yardstick for every other path."""

from __future__ import annotations

import numpy as np

from . import fp8
from . import layouts as L
from . import validation as V
from . import variants as VA
from .bfloat16 import bits_to_float32
from .problem import PageTable


def to_float64(arr) -> np.ndarray:
    """Host float64 copy of a NumPy/CuPy array, including bfloat16 stored as ml_dtypes or uint16."""
    if hasattr(arr, "get"):
        arr = arr.get()
    arr = np.asarray(arr)
    if arr.dtype == np.uint16:   # raw bfloat16 bits
        return bits_to_float32(arr).astype(np.float64)
    return arr.astype(np.float64)


def kv_format(k_cache, kv_dtype):
    """The fp8 format of the caches: ``kv_dtype`` checked, or the caches' own float8 dtype
    (ml_dtypes / torch), or None for 16/32/64-bit caches."""
    if kv_dtype is not None:
        return fp8.fp8_format("kv_dtype", kv_dtype)
    name = V.dtype_name(getattr(k_cache, "dtype", None))
    return name if name in fp8.FP8_FORMATS else None


def kv_to_float64(k_cache, v_cache, num_kv_heads: int, kv_format, k_scale=None,
                  v_scale=None):
    """float64 K and V as the attention uses them: fp8 codes dequantized exactly (or the
    16/32/64-bit values), times their scale (per tensor, or per kv head on axis 2). A cache
    given as None stays None (a caller that needs only one)."""

    scales = {"k": fp8.check_scale("k_scale", k_scale, num_kv_heads),     # both before any work
              "v": fp8.check_scale("v_scale", v_scale, num_kv_heads)}

    def convert(name, cache, scale):
        if cache is None:
            return None
        if kv_format is None:
            x = to_float64(cache)
        else:
            x = fp8.dequantize(fp8.codes_of(f"{name}_cache", cache, kv_format), kv_format)
        return x if scale is None else x * scales[name][:, None]

    return convert("k", k_cache, k_scale), convert("v", v_cache, v_scale)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float,
           soft_cap: float | None = None, bias: np.ndarray | None = None):
    """One request, one kv head group. q: [G, D]; k, v: [N, D]. Returns (o [G, D], lse [G]).

    No keys (N = 0): zeros and -inf. A query row with a non-finite score (NaN, +inf or -inf:
    NaN or Inf in q or K, or a product past the float64 range) gets NaN for its whole output
    and its LSE. A NaN or Inf in V reaches the output components it is summed into (IEEE).
    ``soft_cap``: scores become cap * tanh(score / cap) (the rule above reads the raw score).
    ``bias`` [G, N]: added to the scaled scores before the cap (ALiBi's, ``variants.alibi_bias``).
    """
    if k.shape[0] == 0:
        return np.zeros_like(q), np.full(q.shape[0], -np.inf)
    with np.errstate(over="ignore", invalid="ignore"):    # non-finite results are defined above
        s = (q @ k.T) * sm_scale
        bad = ~np.isfinite(s).all(axis=1)
        if bad.any():    # computed on zero scores (no inf - inf), then set to NaN
            s[bad] = 0
        if bias is not None:
            s = s + bias
        s = VA.cap_scores(s, soft_cap)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        d = p.sum(axis=1, keepdims=True)
        o, lse = (p @ v) / d, (m + np.log(d))[:, 0]
    if bad.any():
        o[bad], lse[bad] = np.nan, np.nan
    return o, lse


def reference_decode(q, k_cache, v_cache, page_table: PageTable, sm_scale: float | None = None,
                     *, kv_dtype=None, k_scale=None, v_scale=None, window_left: int = -1,
                     logits_soft_cap: float | None = None, sinks=None, qo_indptr=None,
                     kv_layout: str = "NHD", attention_chunk_size: int = 0, alibi_slopes=None):
    """Decode attention over a paged cache, in float64.

    q: [batch, num_qo_heads, head_dim]; k_cache, v_cache: [num_pages, page_size, num_kv_heads,
    head_dim] (NHD); any float dtype, NumPy or CuPy (uint16 = raw bfloat16 bits). Any head_dim.
    fp8 caches: ``kv_dtype`` 'float8_e4m3fn' or 'float8_e5m2' (or vLLM's 'fp8_e4m3',
    'fp8_e5m2') with uint8 codes, or caches of that ml_dtypes dtype (then kv_dtype may be
    omitted); dequantized exactly. ``k_scale``, ``v_scale``: K = stored value x k_scale, one
    value per tensor or one per kv head (default 1), for any cache dtype.
    ``window_left``, ``logits_soft_cap``, ``sinks``, ``qo_indptr`` (multi-token decode: q is
    then [qo_indptr[-1], num_qo_heads, head_dim] and so are the outputs),
    ``attention_chunk_size``, ``alibi_slopes``: ``core.variants`` says what each means (the
    reference takes every combination, several query rows in chunks too). ``v_cache=None``: ``k_cache`` is a (k, v) pair or one combined
    array, and ``kv_layout`` 'NHD' or 'HND' (``core.layouts``).
    Returns (out [batch, num_qo_heads, head_dim] float64,
    lse [batch, num_qo_heads] float64, natural log of sum(exp(sm_scale * q.k))).
    A request with no tokens gets zeros and lse -inf (whatever its q holds). A (request, query
    head) with a non-finite score (NaN or Inf in its q or in its kv head's K, or an overflow)
    gets NaN for its whole output and its LSE, never zeros and -inf; other heads and requests
    are unaffected. NaN or Inf in V makes the output components it reaches NaN or +-Inf.
    """
    V.check_instance("page_table", page_table, PageTable)
    k_cache, v_cache = (L.as_nhd(a, kv_layout) for a in L.split_kv(k_cache, v_cache))
    fmt = kv_format(k_cache, kv_dtype)
    rows = VA.query_rows(qo_indptr, page_table.kv_lens)
    hq, hk, d = V.check_attention_arrays(q, k_cache, v_cache, rows.num_rows,
                                         page_table.page_size, page_table.kv_indices,
                                         kv_dtype=fmt)
    sm_scale = V.check_sm_scale(sm_scale, d)
    variant = VA.check_variant(hq, window_left, logits_soft_cap, sinks,
                               attention_chunk_size=attention_chunk_size,
                               alibi_slopes=alibi_slopes)
    q64 = to_float64(q)
    k64, v64 = kv_to_float64(k_cache, v_cache, hk, fmt, k_scale, v_scale)
    g = hq // hk
    k_flat = k64.reshape(-1, hk, d)
    v_flat = v64.reshape(-1, hk, d)
    out = np.zeros((rows.num_rows, hq, d))
    lse = np.full((rows.num_rows, hq), -np.inf)
    for b in range(page_table.batch_size):
        slots = page_table.token_slots(b)
        kv_len = int(page_table.kv_lens[b])
        for j in range(int(rows.count[b])):
            r = int(rows.first[b]) + j
            position = rows.position(b, j, kv_len)
            lo, hi = VA.visible(position, kv_len, variant.window_left,
                                variant.attention_chunk_size)
            seen = slots[lo:hi]
            bias = VA.alibi_bias(variant.alibi_slopes, range(lo, hi), position)
            for h in range(hk):
                heads = slice(h * g, (h + 1) * g)
                out[r, heads], lse[r, heads] = attend(
                    q64[r, heads], k_flat[seen, h], v_flat[seen, h], sm_scale,
                    variant.logits_soft_cap, None if bias is None else bias[heads])
    return VA.add_sinks(out, lse, variant.sinks)
