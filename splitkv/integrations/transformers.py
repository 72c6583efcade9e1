"""``"paged|splitkv"``: splitkv as an attention implementation of Hugging Face transformers'
continuous batching (``model.generate_batch``, ``ContinuousBatchingManager``).

    import splitkv.integrations.transformers as skv
    skv.register()                                    # once per process
    model.set_attn_implementation("paged|splitkv")    # or attn_implementation= at load
    outputs = model.generate_batch(prompts, generation_config=...)

How transformers (5.17) calls it: once per layer and forward step, as
``fn(module, query [1, H, T, D], key, value [1, H_kv, T, D], attention_mask, scaling=...,
cache=PagedAttentionCache, cu_seq_lens_q, cu_seq_lens_k, max_seqlen_q, max_seqlen_k,
block_table, read_index, write_index, softcap=..., s_aux=..., ...)`` and expects
``(output, None)`` with ``output.reshape(1, T, -1)`` the heads concatenated. Each call takes one
of three routes (:func:`decode_route`), decided from host values only:

- ``"block_table"``: a decode-only batch with transformers' block table
  (``block_table [groups, rows, max_blocks]``, -1 padded; one query token a row, rows padded to a
  power of two when CUDA graphs are on). The new K/V go into the cache at each row's next slot,
  then splitkv attends over the pages in place.
- ``"token_table"``: a decode-only batch without a block table (models with sliding-window
  layers, whose cache transformers keeps as a ring and gives no block table). The new K/V are
  written at ``write_index``; splitkv attends over ``read_index``, the token slots, as pages of
  one token. Only recognisable when the batch is not padded (``max_seqlen_q == 1``): with CUDA
  graphs or compile on, transformers pads such batches and they take the next route.
- ``"delegate"``: prefill and mixed batches: transformers' ``paged|sdpa`` with a mask built here
  (transformers builds masks only for its own ``paged|eager``/``paged|sdpa``), or, for a layer with
  a logits soft cap or sinks (which ``paged|sdpa`` ignores), a masked attention written here that
  applies them.

Planning happens once per step and layer group, on the device (``plan_on_device`` inside
``torch.ops.splitkv.paged_decode``), so transformers' CUDA graphs capture it with the forward.

Block tables: transformers 5.17 gives its decode fast path (the block table, and CUDA graphs per
padded batch size) only to flash-attention names. :func:`register` therefore widens that one
check (``continuous_batching.initialization.ensure_decode_fast_path_is_available``) for the
names it registers; ``register(decode_fast_path=False)`` leaves transformers untouched (decode
then takes ``"token_table"`` when unpadded).
"""

from __future__ import annotations

import math
import weakref
from collections import Counter

NAME = "paged|splitkv"
ROUTES = ("block_table", "token_table", "delegate")

_REGISTERED: set[str] = set()
#: calls per route since import (diagnostics: which path a run took)
route_counts: Counter = Counter()
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------- registration
def register(name: str = NAME, *, decode_fast_path: bool = True) -> str:
    """Register ``name`` (``"paged|..."``) in transformers' ``AttentionInterface``, so that
    ``set_attn_implementation(name)`` accepts it; returns the name.

    transformers checks the full string against its registry, so the key is the whole
    ``"paged|splitkv"``, not ``"splitkv"``. ``decode_fast_path``: let transformers hand this
    implementation its block table for decode-only batches (see the module docstring).
    """
    if not isinstance(name, str) or not name.startswith("paged|") or name == "paged|":
        raise ValueError(f"name: expected 'paged|<something>', got {name!r}")
    from transformers import AttentionInterface

    AttentionInterface.register(name, paged_splitkv_attention)
    _REGISTERED.add(name)
    if decode_fast_path:
        _open_decode_fast_path()
    return name


def registered_names() -> frozenset:
    return frozenset(_REGISTERED)


def _open_decode_fast_path() -> None:
    """Keep transformers' ``max_blocks_per_request`` (its block tables) for our names; every
    other implementation goes through transformers' own check unchanged."""
    from transformers.generation.continuous_batching import initialization

    check = initialization.ensure_decode_fast_path_is_available
    if getattr(check, "splitkv_names", None) is not None:
        return

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested, *args, **kwargs):
        if getattr(config, "_attn_implementation", None) in _REGISTERED:
            return None
        return check(config, cb_config, user_requested, *args, **kwargs)

    ensure_decode_fast_path_is_available.splitkv_names = _REGISTERED
    ensure_decode_fast_path_is_available.__wrapped__ = check
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


# --------------------------------------------------------------------------- the decision
def decode_route(num_q_tokens: int, block_table, max_seqlen_q, num_sequences: int) -> str:
    """Which route a call takes, from host values only (a captured graph replays the route of
    its capture, and transformers keys its graphs by these same values).

    num_q_tokens: query's token axis (T); block_table: the kwarg (a tensor or None);
    max_seqlen_q: the kwarg (an int); num_sequences: ``len(cu_seq_lens_q) - 1``.
    """
    if block_table is not None:
        return "block_table"
    if max_seqlen_q == 1 and num_q_tokens == num_sequences:
        return "token_table"
    return "delegate"


class LayerVariant:
    """What a layer asks of the attention: ``window`` (transformers' sliding window, 1 for
    none: a query sees itself and the ``window - 1`` tokens before), ``soft_cap`` (None or a
    positive float), ``sinks`` (a tensor [num_qo_heads] or None) and ``scaling``."""

    __slots__ = ("window", "soft_cap", "sinks", "scaling")

    def __init__(self, window: int, soft_cap, sinks, scaling: float):
        self.window, self.soft_cap, self.sinks, self.scaling = window, soft_cap, sinks, scaling

    @property
    def layer_type(self) -> str:
        return "sliding_attention" if self.window > 1 else "full_attention"

    @property
    def window_left(self) -> int:
        """splitkv's window: the tokens before the query that it sees (-1: all)."""
        return self.window - 1 if self.window > 1 else -1

    @classmethod
    def of(cls, module, cache, query_head_dim: int, scaling, kwargs) -> "LayerVariant":
        window = int(cache.sliding_windows.get(module.layer_idx, 1) or 1)
        soft_cap = kwargs.get("softcap")
        if soft_cap is not None:
            soft_cap = float(soft_cap)
            if not (math.isfinite(soft_cap) and soft_cap >= 0):
                raise ValueError(f"softcap: expected a finite number >= 0, got {soft_cap!r}")
            soft_cap = soft_cap or None
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query_head_dim ** -0.5
        return cls(window, soft_cap, kwargs.get("s_aux"), float(scaling))


def _per_layer_type(value, variant: LayerVariant):
    """``cu_seq_lens_k``/``max_seqlen_k`` come as a dict by layer type when a model mixes them."""
    return value[variant.layer_type] if isinstance(value, dict) else value


# --------------------------------------------------------------------------- the function
def paged_splitkv_attention(module, query, key, value, attention_mask, scaling=None,
                            dropout: float = 0.0, **kwargs):
    """transformers' paged attention interface (see the module docstring). query
    ``[1, H, T, D]``, key/value ``[1, H_kv, T, D]``; returns ``(output, None)``, output
    ``[T, H, D]`` (decode routes) or ``[1, T, H, D]`` (delegated)."""
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError("paged|splitkv: called without a paged attention cache (cache=); it "
                         "serves transformers' continuous batching (generate_batch). Use 'sdpa' "
                         "for a plain forward")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"query: expected [1, num_heads, tokens, head_dim], got "
                         f"{tuple(query.shape)}")
    variant = LayerVariant.of(module, cache, query.shape[-1], scaling, kwargs)
    route = decode_route(query.shape[2], kwargs.get("block_table"), kwargs.get("max_seqlen_q"),
                         kwargs["cu_seq_lens_q"].shape[0] - 1)
    route_counts[route] += 1
    if route == "delegate":
        return _delegate(module, query, key, value, variant, dropout, kwargs)
    return _decode(route, module, query, key, value, variant, cache, kwargs), None


class _CacheState:
    """What the integration keeps per transformers cache: decode sessions and the last mask."""

    def __init__(self):
        self.sessions: dict[tuple, tuple[int, int]] = {}     # key -> (handle, first layer)
        self.mask_key, self.mask = None, None

    def session(self, key: tuple, layer: int, options: dict) -> tuple[int, bool]:
        """(the session's handle, whether this layer plans it: the first layer that used it)."""
        from .torch_ops import new_session

        if key not in self.sessions:
            self.sessions[key] = (new_session(**options), layer)
        handle, first = self.sessions[key]
        return handle, layer == first

    def close(self) -> None:
        from .torch_ops import close_session

        for handle, _ in self.sessions.values():
            close_session(handle)
        self.sessions.clear()


def _state(cache) -> _CacheState:
    state = _STATES.get(cache)
    if state is None:
        state = _STATES[cache] = _CacheState()
        weakref.finalize(cache, state.close)
    return state


def bucket(rows: int) -> int:
    """A session's capacity for a batch of ``rows``: the next power of two (transformers pads
    decode batches to these under CUDA graphs, so each padded size is its own session)."""
    return 1 << max(rows - 1, 0).bit_length()


def _decode(route, module, query, key, value, variant: LayerVariant, cache, kwargs):
    import torch

    from . import torch_ops  # noqa: F401  (registers torch.ops.splitkv.paged_decode)

    layer = module.layer_idx
    group, index_in_group = cache.layer_index_to_group_indices[layer]
    rows, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    kv_heads = cache.num_key_value_heads
    k_pool, v_pool = cache.key_cache[index_in_group], cache.value_cache[index_in_group]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)       # [rows, H_kv, D]
    cu_k = _per_layer_type(kwargs["cu_seq_lens_k"], variant)[:rows + 1]
    if route == "block_table":
        table = kwargs["block_table"][group]                              # [rows, max_blocks]
        page_size = cache.block_size
        seq_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        slots = _next_slots(seq_lens, table, page_size, cache.write_trash_index)
        tables = [seq_lens, table]
        width, window_left = table.shape[1], variant.window_left
    else:
        slots = kwargs["write_index"][group]
        read = kwargs["read_index"][group]
        page_size = 1
        tables = [cu_k.to(torch.int32), _token_slots(read, slots, cu_k, cache.sentinel_index)]
        # the read list already holds only the window's tokens
        width, window_left = cache.num_pages + cache.max_batch_tokens, -1
    k_pool.index_copy_(0, slots, new_k)
    v_pool.index_copy_(0, slots, new_v)
    capacity = bucket(rows)
    options = dict(num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   page_size=page_size, dtype=query.dtype, layout="block_table" if
                   route == "block_table" else "indptr", capacity=capacity, width=width,
                   sm_scale=variant.scaling, logits_soft_cap=variant.soft_cap,
                   window_left=window_left)
    key_ = (route, capacity, group, width, query.dtype, variant.scaling, variant.soft_cap,
            window_left)
    handle, plans = _state(cache).session(key_, layer, options)
    pages = (-1, page_size, kv_heads, head_dim)
    return torch.ops.splitkv.paged_decode(
        query[0].transpose(0, 1), k_pool.view(pages), v_pool.view(pages), tables,
        variant.sinks, handle, plans)


def _next_slots(seq_lens, table, page_size: int, trash: int):
    """The cache slot of each row's new token (its last position, counted in ``seq_lens``);
    ``trash`` for padding rows (length 0). int64 [rows]."""
    import torch

    pos = seq_lens.to(torch.int64) - 1
    safe = pos.clamp(min=0)
    page = table.gather(1, (safe // page_size).unsqueeze(1)).squeeze(1).to(torch.int64)
    slot = page * page_size + safe % page_size
    return torch.where((pos >= 0) & (page >= 0), slot, torch.full_like(slot, trash))


def _token_slots(read, write, cu_k, sentinel: int):
    """``read_index`` with each new token's placeholder (``sentinel``, sliding-window groups)
    replaced by the slot it was written to: the slots splitkv reads, int32 [len(read)]."""
    import torch

    positions = torch.arange(read.shape[0], device=read.device, dtype=cu_k.dtype)
    request = torch.searchsorted(cu_k[1:].contiguous(), positions, right=True)
    request = request.clamp(max=write.shape[0] - 1)
    return torch.where(read == sentinel, write[request], read).to(torch.int32)


# --------------------------------------------------------------------------- delegation
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


def _mask_for(cache, variant: LayerVariant, query, layer: int, kwargs):
    """The mask of this call, reused by the following layers of the step while the lengths
    are unchanged (same tensors, same in-place version)."""
    import torch

    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = _per_layer_type(kwargs["cu_seq_lens_k"], variant)
    num_q = query.shape[2]
    read = kwargs["read_index"][cache.layer_index_to_group_indices[layer][0]]
    num_k = read.shape[0] if read.numel() else num_q     # no cache read: the new keys only
    key, state = None, _state(cache)
    if not torch.compiler.is_compiling():
        # a graph being captured makes its own (one made outside would not be recomputed
        # when the graph replays)
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (cu_q.data_ptr(), cu_q._version, cu_k.data_ptr(), cu_k._version, num_q, num_k,
               variant.window, query.dtype, capturing)
        if key == state.mask_key:
            return state.mask
    mask = varlen_mask(cu_q, cu_k, num_q, num_k, variant.window, query.dtype)
    if key is not None:
        state.mask_key, state.mask = key, mask
    return mask


def _delegate(module, query, key, value, variant: LayerVariant, dropout: float, kwargs):
    cache = kwargs["cache"]
    mask = _mask_for(cache, variant, query, module.layer_idx, kwargs)
    if variant.soft_cap is not None or variant.sinks is not None:
        return _masked_attention(module, query, key, value, mask, variant, kwargs), None
    from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

    rest = {k: v for k, v in kwargs.items() if k not in ("scaling", "dropout")}
    return sdpa_attention_paged_forward(module, query, key, value, mask, dropout=dropout,
                                        scaling=variant.scaling, **rest)


def _masked_attention(module, query, key, value, mask, variant: LayerVariant, kwargs):
    """Attention of a packed batch with the soft cap and sinks applied, in float32 (what
    ``paged|sdpa`` leaves out). Returns [1, T, H, D] in query's dtype."""
    import torch

    cache = kwargs["cache"]
    keys, values = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                read_index=kwargs["read_index"],
                                write_index=kwargs["write_index"])          # [K, H_kv, D]
    heads = query.shape[1]
    group = heads // keys.shape[1]
    keys = keys.transpose(0, 1).repeat_interleave(group, dim=0).float()      # [H, K, D]
    values = values.transpose(0, 1).repeat_interleave(group, dim=0).float()
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
