"""Exact merging of attention states (output, log-sum-exp) computed over disjoint KV segments.

If ``o_a, lse_a`` is attention over KV segment A and ``o_b, lse_b`` over segment B (same
queries, same ``sm_scale``, natural-log LSE), then ``merge_states`` gives attention over A+B:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

This is how splitkv combines the chunks of a split request, and what a user needs to combine
attention over a shared prefix and a private suffix (cascade), or over KV shards held by
several GPUs. Works on NumPy and CuPy arrays alike (computed in float64 when ``o`` is float64,
in float32 otherwise; the output has the dtype of ``o``, the LSE that of the computation).

Non-finite values, row by row (a row is one query head of one request):

- ``lse = -inf`` is an empty segment: weight 0, it contributes nothing. Merging only empty
  segments gives zeros and ``-inf``.
- ``lse = NaN`` is how attention reports a non-finite score (NaN or Inf in q or K), and
  ``lse = +inf`` is the LSE of no finite set of scores: if any state of a row has either, the
  merged output and LSE of that row are NaN, never zeros and ``-inf``.
- A NaN or Inf in an ``o`` reaches the merged output's component by IEEE arithmetic: it is
  multiplied by its state's weight, so even a state of weight 0 (an empty one) makes that
  component NaN; the LSE is unaffected.
"""

from __future__ import annotations

import numpy as np

from . import validation as V
from .bfloat16 import array_namespace


def merge_states_n(o, lse):
    """Merge states along axis 0.

    o: [num_states, ..., head_dim], float16, bfloat16, float32 or float64; lse: [num_states,
    ...] (natural log), float32 or float64; NumPy or CuPy, one package.
    Returns (o_merged [..., head_dim] of o's dtype, lse_merged [...] float64 if o is float64,
    else float32). Non-finite values as in the module docstring.
    """
    o, lse = V.check_merge_states_n(o, lse)
    xp = array_namespace(o)
    acc = np.float64 if o.dtype == np.float64 else np.float32
    lse = lse.astype(acc, copy=False)
    # No extra pass for non-finite rows: a NaN or +inf LSE gives a NaN weight (NaN - m or
    # inf - inf), so the total, the output and the LSE of that row are NaN by IEEE arithmetic.
    with np.errstate(invalid="ignore", divide="ignore"):     # NumPy's warnings; CuPy has none
        m = lse.max(axis=0)
        m_safe = xp.where(m == -np.inf, 0, m)                 # only empty states: exp(-inf) = 0
        w = xp.exp(lse - m_safe[None])
        total = w.sum(axis=0)                                 # 0: only empty states; NaN: bad LSE
        safe_total = xp.where(total > 0, total, 1)
        out = (o.astype(acc, copy=False) * (w / safe_total)[..., None]).sum(axis=0)
        # Only empty states: out is sum(o * 0), so +-0, or NaN where an o is not finite; + 0
        # makes it +0. A NaN row stays NaN.
        out = xp.where((total > 0)[..., None], out, out + 0)
        lse_out = xp.where(total == 0, -np.inf, m_safe + xp.log(total))
    return out.astype(o.dtype, copy=False), lse_out.astype(acc, copy=False)


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two states. o_*: [..., head_dim]; lse_*: [...]; o_b of the dtype of o_a, lse_b of
    that of lse_a (dtypes and non-finite values as in ``merge_states_n``). Returns (o, lse)."""
    o_a, lse_a, o_b, lse_b = V.check_merge_states(o_a, lse_a, o_b, lse_b)
    xp = array_namespace(o_a)
    return merge_states_n(xp.stack([o_a, o_b]), xp.stack([lse_a, lse_b]))
