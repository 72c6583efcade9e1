"""Runs a plan on the CPU exactly the way the GPU does: one partial state per (chunk, query
head), then the merge. It proves the decomposition math on any machine, and is the demo's
fallback when there is no GPU."""

from __future__ import annotations

import numpy as np

from . import validation as V
from .merge import merge_states_n
from .plan import Plan
from .problem import PageTable
from . import layouts as L
from . import variants as VA
from .reference import attend, kv_format, kv_to_float64, to_float64


def bits_as(array, dtype: str):
    """uint16 holds the bits of the plan's 16-bit dtype, as on the GPU: float16 bits are viewed
    as float16 (the host paths read a bare uint16 as bfloat16 bits)."""
    if dtype == "float16" and str(array.dtype) == "uint16":
        return array.view("float16")
    return array


def compute_partials(plan: Plan, q, k_cache, v_cache, page_table: PageTable, sm_scale=None, *,
                     kv_dtype=None, k_scale=None, v_scale=None, window_left: int | None = None,
                     logits_soft_cap=None, qo_indptr=None, kv_layout: str = "NHD",
                     attention_chunk_size: int | None = None, alibi_slopes=None):
    """Partial states, float64: (partial_o [num_chunks, num_qo_heads, head_dim],
    partial_lse [num_chunks, num_qo_heads]); with ``qo_indptr``, one per query row of the
    chunk's request: [num_chunks, max q_len, ...] (rows past a request's q_len stay empty).
    ``window_left``: None runs the plan's window (its problem's ``window_left``, -1: none); a
    value must be the plan's, except that a plan without a window may run any (it covers
    every token, and each query masks its own window); query rows of a windowed plan
    (``qo_indptr``) give theirs, which the plan was made to cover. ``attention_chunk_size``:
    None runs the plan's; a value must be the plan's (one query row a request)."""
    V.check_instance("plan", plan, Plan)
    V.check_instance("page_table", page_table, PageTable)
    p = plan.problem
    V.check_plan_for_table(plan, page_table, attention_chunk_size=(
        None if attention_chunk_size is None else VA.check_chunk_size(attention_chunk_size)))
    k_cache, v_cache = (L.as_nhd(a, kv_layout) for a in L.split_kv(k_cache, v_cache))
    fmt = kv_format(k_cache, kv_dtype)
    rows = VA.query_rows(qo_indptr, p.kv_lens)
    V.check_attention_arrays(q, k_cache, v_cache, rows.num_rows, p.page_size,
                             page_table.kv_indices, p.num_qo_heads, p.num_kv_heads, p.head_dim,
                             kv_dtype=fmt)
    q, k_cache, v_cache = (bits_as(a, p.dtype) for a in (q, k_cache, v_cache))
    sm_scale = V.check_sm_scale(sm_scale, p.head_dim)
    variant = VA.check_variant(p.num_qo_heads, -1 if window_left is None else window_left,
                               logits_soft_cap, alibi_slopes=alibi_slopes)
    slopes = variant.alibi_slopes
    VA.refuse_chunks_with_rows(p.attention_chunk_size, rows.max_q_len)
    if p.windowed and rows.max_q_len > 1:
        # several rows: the plan covers every row's window and each row masks its own, as the
        # GPU's multi-token build does
        if variant.window_left < 0:
            raise ValueError(f"window_left: a plan made for window_left={p.window_left} runs "
                             "query rows of the window they were planned for; give it")
        need = VA.covering_window_left(variant.window_left, rows.max_q_len)
        if p.window_left < need:
            raise ValueError(f"qo_indptr: {rows.max_q_len} query rows with window_left="
                             f"{variant.window_left} need a plan that covers window_left={need} "
                             f"(variants.covering_window_left); the plan covers "
                             f"{p.window_left}")
    elif p.windowed:    # a plan over windows (or chunks): its chunks are what is seen, as on
        # the GPU
        if window_left is not None and variant.window_left != p.window_left:
            raise ValueError(f"window_left: the plan was made for window_left={p.window_left}, "
                             f"this call has {variant.window_left}"
                             f"{' (no window)' if variant.window_left < 0 else ''}; leave it "
                             "out to run the plan's window")
        # no mask: the chunks alone say what is read (a plan that read more would be wrong here
        # as it would be on the GPU, whose kernels mask nothing before a chunk)
        variant = VA.Variant(-1, variant.logits_soft_cap, alibi_slopes=slopes)
    q64 = to_float64(q)
    k64, v64 = kv_to_float64(k_cache, v_cache, p.num_kv_heads, fmt, k_scale, v_scale)
    g, hk, d = p.group_size, p.num_kv_heads, p.head_dim
    k_flat, v_flat = k64.reshape(-1, hk, d), v64.reshape(-1, hk, d)
    width = rows.max_q_len
    partial_o = np.zeros((plan.num_chunks, width, p.num_qo_heads, d))
    partial_lse = np.full((plan.num_chunks, width, p.num_qo_heads), -np.inf)
    slots_by_request = {}
    for c in range(plan.num_chunks):
        b = int(plan.chunk_request[c])
        if b not in slots_by_request:
            slots_by_request = {b: page_table.token_slots(b)}
        slots, kv_len = slots_by_request[b], int(p.kv_lens[b])
        begin, end = int(plan.chunk_start[c]), int(plan.chunk_end[c])
        for j in range(int(rows.count[b])):
            position = rows.position(b, j, kv_len)
            lo, hi = VA.visible(position, kv_len, variant.window_left)
            first, last = max(begin, lo), max(min(end, hi), max(begin, lo))
            seen = slots[first:last]
            bias = VA.alibi_bias(slopes, range(first, last), position)
            r = int(rows.first[b]) + j
            for h in range(hk):
                heads = slice(h * g, (h + 1) * g)
                partial_o[c, j, heads], partial_lse[c, j, heads] = attend(
                    q64[r, heads], k_flat[seen, h], v_flat[seen, h], sm_scale,
                    variant.logits_soft_cap, None if bias is None else bias[heads])
    if qo_indptr is None:
        return partial_o[:, 0], partial_lse[:, 0]
    return partial_o, partial_lse


def merge_partials(plan: Plan, partial_o: np.ndarray, partial_lse: np.ndarray, *,
                   qo_indptr=None, sinks=None):
    """Combine each request's chunks in chunk order (the GPU merges in the same fixed order),
    then join the sinks (``variants.add_sinks``)."""
    p = plan.problem
    rows = VA.query_rows(qo_indptr, p.kv_lens)
    variant = VA.check_variant(p.num_qo_heads, sinks=sinks)
    if qo_indptr is None:
        partial_o, partial_lse = partial_o[:, None], partial_lse[:, None]
    out = np.zeros((rows.num_rows, p.num_qo_heads, p.head_dim), dtype=partial_o.dtype)
    lse = np.full((rows.num_rows, p.num_qo_heads), -np.inf)
    for b in range(p.batch_size):
        lo, hi = plan.merge_indptr[b], plan.merge_indptr[b + 1]
        for j in range(int(rows.count[b])):
            r = int(rows.first[b]) + j
            out[r], lse[r] = merge_states_n(partial_o[lo:hi, j], partial_lse[lo:hi, j])
    return VA.add_sinks(out, lse, variant.sinks)


def execute_plan_cpu(plan: Plan, q, k_cache, v_cache, page_table: PageTable, sm_scale=None, *,
                     kv_dtype=None, k_scale=None, v_scale=None, window_left: int | None = None,
                     logits_soft_cap=None, sinks=None, qo_indptr=None, kv_layout: str = "NHD",
                     attention_chunk_size: int | None = None, alibi_slopes=None):
    """Run ``plan`` on the host. q: [batch, num_qo_heads, head_dim]; k_cache, v_cache:
    [num_pages, page_size, num_kv_heads, head_dim] (NHD), any float dtype (computed in float64),
    or fp8 with ``kv_dtype`` and the scales as ``reference_decode`` takes them; the variants
    (``window_left``, ``logits_soft_cap``, ``sinks``, ``qo_indptr``, ``attention_chunk_size``,
    ``alibi_slopes``) as ``core.variants`` defines them (``window_left`` and
    ``attention_chunk_size`` None: the plan's; see ``compute_partials``); K/V as
    two arrays, a pair or a combined array, NHD or HND (``core.layouts``).
    Returns (out [batch, num_qo_heads, head_dim], lse [batch, num_qo_heads]),
    float64, with a row per query row instead of per request under ``qo_indptr``.

    Non-finite inputs give what ``reference_decode`` gives, for every strategy and split: a
    chunk with a non-finite score (NaN or Inf in q or K) has a NaN LSE, and ``merge_states_n``
    turns a NaN LSE into a NaN output and LSE for that (request, query head); a request with no
    tokens gets zeros and -inf; NaN or Inf in V reaches the output components it is summed into.
    Other requests and heads are unaffected."""
    if sinks is not None:      # checked before any work
        VA.check_variant(plan.problem.num_qo_heads, sinks=sinks)
    partial_o, partial_lse = compute_partials(plan, q, k_cache, v_cache, page_table, sm_scale,
                                              kv_dtype=kv_dtype, k_scale=k_scale,
                                              v_scale=v_scale, window_left=window_left,
                                              logits_soft_cap=logits_soft_cap,
                                              qo_indptr=qo_indptr, kv_layout=kv_layout,
                                              attention_chunk_size=attention_chunk_size,
                                              alibi_slopes=alibi_slopes)
    return merge_partials(plan, partial_o, partial_lse, qo_indptr=qo_indptr, sinks=sinks)
