"""Exact merging of attention states (output, log-sum-exp) computed over disjoint KV segments.

If ``o_a, lse_a`` is attention over KV segment A and ``o_b, lse_b`` over segment B (same
queries, same ``sm_scale``, natural-log LSE), then ``merge_states`` gives attention over A+B:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

This is how splitkv combines the chunks of a split request, and what a user needs to combine
attention over a shared prefix and a private suffix (cascade), or over KV shards held by
several GPUs. An empty segment has ``lse = -inf`` and contributes nothing; merging only empty
segments gives zeros and ``-inf``. Works on NumPy and CuPy arrays alike (computed in float32
or better; the output has the dtype of ``o_a``).
"""

from __future__ import annotations

import numpy as np

from .bfloat16 import array_namespace


def _check_pair(o, lse, name_o: str, name_lse: str):
    if tuple(o.shape[:-1]) != tuple(lse.shape):
        raise ValueError(f"{name_lse}: expected shape {list(o.shape[:-1])} (the shape of {name_o} "
                         f"without its last axis), got {list(lse.shape)}")


def merge_states_n(o, lse):
    """Merge states along axis 0.

    o: [num_states, ..., head_dim]; lse: [num_states, ...] (natural log).
    Returns (o_merged [..., head_dim], lse_merged [...]).
    """
    _check_pair(o, lse, "o", "lse")
    if o.shape[0] == 0:
        raise ValueError("o: expected at least one state along axis 0, got 0")
    xp = array_namespace(o)
    acc = np.float64 if o.dtype == np.float64 else np.float32
    lse = lse.astype(acc, copy=False)
    m = lse.max(axis=0)
    finite = xp.isfinite(m)
    m_safe = xp.where(finite, m, 0)
    w = xp.exp(lse - m_safe[None])                        # exp(-inf) = 0 for empty states
    total = w.sum(axis=0)
    safe_total = xp.where(total > 0, total, 1)
    out = (o.astype(acc, copy=False) * (w / safe_total)[..., None]).sum(axis=0)
    out = xp.where((total > 0)[..., None], out, 0)
    lse_out = xp.where(total > 0, m_safe + xp.log(safe_total), -np.inf)
    return out.astype(o.dtype, copy=False), lse_out.astype(acc, copy=False)


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two states. o_*: [..., head_dim]; lse_*: [...]. Returns (o, lse)."""
    _check_pair(o_a, lse_a, "o_a", "lse_a")
    _check_pair(o_b, lse_b, "o_b", "lse_b")
    if tuple(o_a.shape) != tuple(o_b.shape):
        raise ValueError(f"o_b: expected shape {list(o_a.shape)} (the shape of o_a), got {list(o_b.shape)}")
    xp = array_namespace(o_a)
    return merge_states_n(xp.stack([o_a, o_b]), xp.stack([lse_a, lse_b]))
