"""Prefill, mixed and padded batches: transformers' own SDPA attention with a mask built here,
or, for a layer with a logits soft cap or sinks (which SDPA leaves out), a masked attention
written here that applies them.

transformers builds masks only for its own ``sdpa`` and ``paged|eager``, so the mask of a
packed batch is built here, on the device, from ``cu_seq_lens_q``/``cu_seq_lens_k`` (equal to
transformers' ``build_attention_mask``, sliding window included).
"""

from __future__ import annotations

from .attention import LayerVariant, gathered_keys, per_layer_type, state_of

#: the kwargs SDPA must not see: ours, ones it refuses (a soft cap), and the cache (5.19-5.23's
#: SDPA would update it a second time)
_NOT_FOR_SDPA = ("scaling", "dropout", "softcap", "is_causal", "s_aux", "sliding_window",
                 "cache")


def varlen_mask(cu_seq_lens_q, cu_seq_lens_k, num_q: int, num_k: int, window: int, dtype):
    """The additive mask of a packed batch, ``[1, 1, num_q, num_k]`` in ``dtype``: query row i
    of request r sees request r's keys up to its own position (and, with ``window > 1``, only
    the last ``window`` of them); everything else, padding rows included, gets dtype's lowest
    value (not -inf, so a fully masked row stays finite). Device ops only (capturable)."""
    import torch

    cu_q, cu_k = cu_seq_lens_q.to(torch.int64), cu_seq_lens_k.to(torch.int64)
    device, num_seq = cu_q.device, cu_q.shape[0] - 1
    qi = torch.arange(num_q, device=device)
    ki = torch.arange(num_k, device=device)
    rq = torch.searchsorted(cu_q[1:].contiguous(), qi, right=True)
    r = rq.clamp(max=max(num_seq - 1, 0))
    q_len, k_len = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
    # a request's keys are one run of rows: row i sees [first, last] of its own run
    last = cu_k[r] + (k_len - q_len) + (qi - cu_q[r])
    first = cu_k[r] if window <= 1 else torch.maximum(cu_k[r], last - window + 1)
    last = torch.where(rq < num_seq, last, torch.full_like(last, -1))      # padding rows: none
    ok = (ki[None, :] >= first[:, None]) & (ki[None, :] <= last[:, None])
    mask = torch.full((num_q, num_k), torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.masked_fill_(ok, 0)[None, None]


def mask_for(owner, variant: LayerVariant, query, key, kwargs):
    """The mask of this call over ``key``, the batch's gathered keys, reused by the following
    layers of the step while the lengths are unchanged (same tensors, same in-place
    version)."""
    import torch

    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = per_layer_type(kwargs["cu_seq_lens_k"], variant)
    num_q = query.shape[2]
    num_k = key.shape[2]
    window = variant.window
    mask_key, state = None, state_of(owner)
    if not torch.compiler.is_compiling():
        # a graph being captured makes its own (one made outside would not be recomputed
        # when the graph replays)
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        mask_key = (cu_q.data_ptr(), cu_q._version, cu_k.data_ptr(), cu_k._version, num_q,
                    num_k, window, query.dtype, capturing)
        if mask_key == state.mask_key:
            return state.mask
    mask = varlen_mask(cu_q, cu_k, num_q, num_k, window, query.dtype)
    if mask_key is not None:
        state.mask_key, state.mask = mask_key, mask
    return mask


def delegate(module, query, key, value, variant: LayerVariant, dropout: float, gathered: bool,
             owner, kwargs):
    """Attention of a prefill, mixed or padded batch; returns transformers' ``(output, None)``.
    ``owner``: the cache or the model's config (5.24+), whose state keeps the mask."""
    if not gathered:               # 5.17-5.18: the new K/V go into the cache, the batch's come back
        key, value = (x.transpose(0, 1).unsqueeze(0)
                      for x in gathered_keys(module, key, value, owner, kwargs))
    mask = mask_for(owner, variant, query, key, kwargs)
    if variant.soft_cap is not None or variant.sinks is not None:
        return masked_attention(query, key, value, mask, variant), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rest = {k: v for k, v in kwargs.items() if k not in _NOT_FOR_SDPA}
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=variant.scaling, is_causal=False, **rest)


def masked_attention(query, key, value, mask, variant: LayerVariant):
    """Attention of a packed batch with the soft cap and sinks applied, in float32. query
    [1, H, T, D], key/value [1, H_kv, K, D]; returns [1, T, H, D] in query's dtype."""
    import torch

    heads = query.shape[1]
    group = heads // key.shape[1]
    keys = key[0].repeat_interleave(group, dim=0).float()                   # [H, K, D]
    values = value[0].repeat_interleave(group, dim=0).float()
    scores = torch.matmul(query[0].float(), keys.transpose(1, 2)) * variant.scaling  # [H, T, K]
    if variant.soft_cap is not None:
        scores = torch.tanh(scores / variant.soft_cap) * variant.soft_cap
    scores = scores + mask[0].float()
    if variant.sinks is not None:
        sink = variant.sinks.float().view(heads, 1, 1).expand(heads, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if variant.sinks is not None:
        weights = weights[..., :-1]
    out = torch.matmul(weights, values)                                      # [H, T, D]
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0)
