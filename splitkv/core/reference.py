"""Exact decode attention in float64 NumPy: the yardstick for every other path."""

from __future__ import annotations

import numpy as np

from . import validation as V
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


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float):
    """One request, one kv head group. q: [G, D]; k, v: [N, D]. Returns (o [G, D], lse [G]).

    No keys (N = 0): zeros and -inf. A query row with a non-finite score (NaN, +inf or -inf:
    NaN or Inf in q or K, or a product past the float64 range) gets NaN for its whole output
    and its LSE. A NaN or Inf in V reaches the output components it is summed into (IEEE).
    """
    if k.shape[0] == 0:
        return np.zeros_like(q), np.full(q.shape[0], -np.inf)
    with np.errstate(over="ignore", invalid="ignore"):    # non-finite results are defined above
        s = (q @ k.T) * sm_scale
        bad = ~np.isfinite(s).all(axis=1)
        if bad.any():    # computed on zero scores (no inf - inf), then set to NaN
            s[bad] = 0
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        d = p.sum(axis=1, keepdims=True)
        o, lse = (p @ v) / d, (m + np.log(d))[:, 0]
    if bad.any():
        o[bad], lse[bad] = np.nan, np.nan
    return o, lse


def reference_decode(q, k_cache, v_cache, page_table: PageTable, sm_scale: float | None = None):
    """Decode attention over a paged cache, in float64.

    q: [batch, num_qo_heads, head_dim]; k_cache, v_cache: [num_pages, page_size, num_kv_heads,
    head_dim] (NHD); any float dtype, NumPy or CuPy (uint16 = raw bfloat16 bits). Any head_dim.
    Returns (out [batch, num_qo_heads, head_dim] float64,
    lse [batch, num_qo_heads] float64, natural log of sum(exp(sm_scale * q.k))).
    A request with no tokens gets zeros and lse -inf (whatever its q holds). A (request, query
    head) with a non-finite score (NaN or Inf in its q or in its kv head's K, or an overflow)
    gets NaN for its whole output and its LSE, never zeros and -inf; other heads and requests
    are unaffected. NaN or Inf in V makes the output components it reaches NaN or +-Inf.
    """
    V.check_instance("page_table", page_table, PageTable)
    hq, hk, d = V.check_attention_arrays(q, k_cache, v_cache, page_table.batch_size,
                                         page_table.page_size, page_table.kv_indices)
    sm_scale = V.check_sm_scale(sm_scale, d)
    q64, k64, v64 = to_float64(q), to_float64(k_cache), to_float64(v_cache)
    batch = page_table.batch_size
    g = hq // hk
    k_flat = k64.reshape(-1, hk, d)
    v_flat = v64.reshape(-1, hk, d)
    out = np.zeros((batch, hq, d))
    lse = np.full((batch, hq), -np.inf)
    for b in range(batch):
        slots = page_table.token_slots(b)
        for h in range(hk):
            heads = slice(h * g, (h + 1) * g)
            out[b, heads], lse[b, heads] = attend(q64[b, heads], k_flat[slots, h], v_flat[slots, h],
                                                  sm_scale)
    return out, lse
