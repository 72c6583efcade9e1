"""The unified max (FlashDecoding++'s "asynchronized softmax"), the host's side of it.

The online softmax offsets each score by the running maximum, so a tile needs that maximum
across its lanes and the output a rescale whenever it moves. The scores of a given model fall
in a narrow range, so a fixed value phi can stand in: p = exp(s - phi), O = sum p v and
d = sum p, with no maximum and no rescale, and partial states that combine by plain sums.

That is exact only while exp(m - phi), for m the largest score a CTA sees of a row, stays in
a band: above it, P overflows its MMA type (float16 holds 2**15) or O could overflow where the
running max's would not; below it, P loses precision in float16's subnormals. The kernels
(``UNIFIED_MAX`` in decode.cu) check each row of each CTA after streaming its tokens, and a
CTA with a row outside its band, or a non-finite d or o (a NaN or Inf input), streams its
tokens again with the running max: the fallback. Results are then the exact mode's on every
input; only the time depends on phi.

The band, in base 2 (``band_log2``): m - phi in [-LO, HI] with HI = 15 and LO = 60 where P is
bfloat16 (16-bit K/V with bfloat16 q) or 3 where it is float16 (float16 q, or fp8 K/V, whose
MMAs are float16). ``fallback_items`` predicts which (chunk, kv head) items fall back, on the
host, from the inputs; ``choose_unified_max`` picks a phi from measured row maxima (the
middle of the band at the middle of their span).
"""

from __future__ import annotations

import numpy as np

from . import validation as V

LOG2E = float(np.log2(np.e))
BAND_HI_LOG2 = 15
BAND_LO_LOG2 = {"bfloat16": 60, "float16": 3}


def check_unified_max(value, name: str = "unified_max") -> float | None:
    """``unified_max`` (or ``name``): None (the running max) or a finite number, phi in the
    units of the scaled scores s = sm_scale q.k (after the soft cap), natural log."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a number (phi, natural-log units of the scaled "
                        f"scores) or None, got {type(value).__name__}")
    phi = float(value)
    if not np.isfinite(phi):
        raise ValueError(f"{name}: expected a finite value, got {value!r}")
    if abs(phi) > 1e4:
        raise ValueError(f"{name}: |phi| must be at most 1e4 (scores are that small "
                         f"before exp overflows float32 many times over), got {value!r}")
    return phi


def mma_dtype(dtype: str, kv_dtype: str | None) -> str:
    """The type P is packed in for the P V product: float16 with fp8 K/V or float16 q (q's
    ``dtype`` and ``kv_dtype`` checked as the wrapper checks them)."""
    from . import fp8

    dtype = V.check_dtype("dtype", dtype)
    if fp8.fp8_format("kv_dtype", kv_dtype) or dtype == "float16":
        return "float16"
    return "bfloat16"


def band_log2(dtype: str, kv_dtype: str | None = None) -> tuple[int, int]:
    """(LO, HI): a row is in band where m - phi (base 2) lies in [-LO, HI]."""
    return BAND_LO_LOG2[mma_dtype(dtype, kv_dtype)], BAND_HI_LOG2


def band(dtype: str, kv_dtype: str | None = None) -> tuple[float, float]:
    """The band in natural-log units: (lowest, highest) m - phi that runs without fallback."""
    lo, hi = band_log2(dtype, kv_dtype)
    return -lo / LOG2E, hi / LOG2E


def in_band(row_max, phi: float, dtype: str, kv_dtype: str | None = None):
    """Whether rows whose largest score is ``row_max`` (natural log; -inf: no token) run with
    the unified max, as the kernels decide it (in float32, base 2)."""
    lo, hi = band_log2(dtype, kv_dtype)
    m2 = np.asarray(row_max, np.float64) * LOG2E
    x = (m2.astype(np.float32) - np.float32(np.float32(phi * LOG2E))).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return (m2 == -np.inf) | ((x >= -lo) & (x <= hi))


def choose_unified_max(row_maxima, dtype: str, kv_dtype: str | None = None,
                       quantile: float = 0.001) -> float:
    """A phi for a model from measured row maxima (the largest scaled score of each query row
    of some chunks, natural log, e.g. from ``row_maxima``): the span of their ``quantile``-th
    to (1 - ``quantile``)-th quantiles centred in the band, so that the margin to either edge
    is the same."""
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float, np.floating)) \
            or not 0 <= quantile < 0.5:
        raise ValueError(f"quantile: expected a number in [0, 0.5), got {quantile!r}")
    m = np.asarray(row_maxima, np.float64).ravel()
    m = m[np.isfinite(m)]
    if not m.size:
        raise ValueError("row_maxima: expected some finite row maxima")
    lo, hi = band(dtype, kv_dtype)
    low, high = np.quantile(m, [quantile, 1 - quantile])
    return float((low + high) / 2 - (lo + hi) / 2)


def row_maxima(plan, q, k_cache, page_table, sm_scale=None, *, kv_dtype=None, k_scale=None,
               logits_soft_cap=None, kv_layout: str = "NHD"):
    """The largest scaled score of each (chunk, query head) of ``plan``, float64 [num_chunks,
    num_qo_heads] (-inf for a chunk with no token; NaN where a score is not finite), one query
    row a request: what the kernels' band check reads. q, k_cache, kv_dtype, k_scale and
    kv_layout as ``reference_decode`` takes them (checked the same way)."""
    from . import layouts as L
    from . import variants as VA
    from .plan import Plan
    from .problem import PageTable
    from .reference import kv_format, kv_to_float64, to_float64

    V.check_instance("plan", plan, Plan)
    V.check_instance("page_table", page_table, PageTable)
    V.check_plan_for_table(plan, page_table)
    p = plan.problem
    k_cache = L.as_nhd(k_cache, kv_layout)
    fmt = kv_format(k_cache, kv_dtype)
    V.check_attention_arrays(q, k_cache, k_cache, p.batch_size, p.page_size,
                             page_table.kv_indices, p.num_qo_heads, p.num_kv_heads, p.head_dim,
                             kv_dtype=fmt)
    sm_scale = V.check_sm_scale(sm_scale, p.head_dim)
    cap = VA.check_variant(p.num_qo_heads, logits_soft_cap=logits_soft_cap).logits_soft_cap
    q64 = to_float64(q)
    k64, _ = kv_to_float64(k_cache, None, p.num_kv_heads, fmt, k_scale)
    k_flat = k64.reshape(-1, p.num_kv_heads, p.head_dim)
    g = p.group_size
    out = np.full((plan.num_chunks, p.num_qo_heads), -np.inf)
    for c in range(plan.num_chunks):
        b = int(plan.chunk_request[c])
        slots = page_table.token_slots(b)[int(plan.chunk_start[c]):int(plan.chunk_end[c])]
        if not slots.size:
            continue
        for h in range(p.num_kv_heads):
            heads = slice(h * g, (h + 1) * g)
            with np.errstate(over="ignore", invalid="ignore"):
                s = q64[b, heads] @ k_flat[slots, h].T * sm_scale
                bad = ~np.isfinite(s).all(axis=1)
                s = VA.cap_scores(np.where(np.isfinite(s), s, 0), cap)
                out[c, heads] = np.where(bad, np.nan, s.max(axis=1))
    return out


def fallback_items(plan, q, k_cache, v_cache, page_table, phi: float, dtype: str, *,
                   sm_scale=None, kv_dtype=None, k_scale=None, v_scale=None,
                   logits_soft_cap=None, kv_layout: str = "NHD") -> np.ndarray:
    """Which (chunk, kv head) items of ``plan`` fall back to the running max under ``phi``:
    bool [num_chunks, num_kv_heads]. A row out of band, a non-finite score, or a non-finite
    value in V among the item's tokens (which makes o non-finite). One CTA per item where the
    group fits one (up to 64 query heads), so it is the kernels' count of fallbacks per run.
    Not modelled: O overflowing float32 in the unified pass from finite but huge V (|v| near
    2**82 and more in bf16, or an fp8 v_scale past ~1e27), where the kernels fall back and this
    says they do not (the results are exact either way); and multi-token rows."""
    from . import layouts as L
    from .reference import kv_format, kv_to_float64

    phi = check_unified_max(phi, "phi")
    if phi is None:
        raise TypeError("phi: expected a number (the unified max), got None")
    p = plan.problem
    k_cache, v_cache = (L.as_nhd(a, kv_layout) for a in (k_cache, v_cache))
    fmt = kv_format(k_cache, kv_dtype)
    maxima = row_maxima(plan, q, k_cache, page_table, sm_scale, kv_dtype=fmt,
                        k_scale=k_scale, logits_soft_cap=logits_soft_cap)
    with np.errstate(invalid="ignore"):
        out_rows = ~in_band(maxima, phi, dtype, fmt) | np.isnan(maxima)
    items = out_rows.reshape(plan.num_chunks, p.num_kv_heads, p.group_size).any(axis=2)
    _, v64 = kv_to_float64(None, v_cache, p.num_kv_heads, fmt, v_scale=v_scale)
    v_flat = v64.reshape(-1, p.num_kv_heads, p.head_dim)
    for c in range(plan.num_chunks):
        b = int(plan.chunk_request[c])
        slots = page_table.token_slots(b)[int(plan.chunk_start[c]):int(plan.chunk_end[c])]
        items[c] |= ~np.isfinite(v_flat[slots]).all(axis=(0, 2))
    return items
