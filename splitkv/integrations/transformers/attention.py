"""The attention function transformers' continuous batching calls, once per layer and step.

``fn(module, query [1, H, T, D], key, value, attention_mask, scaling=..., cache=..., **kwargs)``
returns ``(output, None)``, ``output.reshape(1, T, -1)`` the heads side by side. What arrives
depends on the release:

- 5.17-5.18: ``key``/``value`` are the step's new tokens ``[1, H_kv, T, D]``; the function writes
  them (``read_index``/``write_index``, or the next slot of each row with a ``block_table``
  ``[groups, rows, blocks]``); ``cu_seq_lens_k`` is a dict by layer type when layers differ.
- 5.19-5.23: the function calls ``cache.update(key, value, layer_idx, kwargs=kwargs)``, which
  leaves the call as 5.24's.
- 5.24+: the model calls ``cache.update`` first. With a block table the kwargs carry this
  layer's ``block_table [rows, blocks]``, ``k_cache``/``v_cache`` ``[pages, page_size, H_kv, D]``
  and the new tokens, which the attention writes; otherwise ``key``/``value`` are already the
  gathered keys and values ``[1, H_kv, K, D]``, each request's ``cu_seq_lens_k`` run of them.

Each call takes one of five routes (:func:`decode_route`), from host values only (a captured
graph replays the route of its capture, and transformers keys its graphs by the same values):
``"block_table"`` (decode over the cache's pages in place), ``"token_table"`` (5.17-5.18: a
decode batch over ``read_index``, one-token pages), ``"gathered"`` (5.19+: a decode batch over the
gathered keys), ``"token_rows"`` (a padded or mixed batch of at most ``TOKEN_ROWS_LIMIT``
tokens: every query token a decode row over its own request's keys up to itself; this is how
sliding-window models, which get no block table, decode under CUDA graphs) and ``"delegate"``
(larger prefill and mixed batches: :mod:`.delegate`).
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections import Counter

ROUTES = ("block_table", "token_table", "gathered", "token_rows", "delegate")

#: calls per route since import (diagnostics: which path a run took)
route_counts: Counter = Counter()
_UPDATE_TAKES_KWARGS: dict = {}   # cache class -> whether its update takes kwargs
_STATES: dict = {}              # id(cache or config) -> CacheState, dropped with its owner


#: batches of at most this many query tokens that are not plain decode batches (padded under
#: CUDA graphs, or mixed) run through splitkv one query token a row ("token_rows"); larger ones
#: are delegated. A row costs what a decode request of its length costs, so such a step costs at
#: most what a decode batch of this many requests does.
TOKEN_ROWS_LIMIT = 64


def decode_route(num_q_tokens: int, block_table, max_seqlen_q, num_sequences: int, *,
                 gathered: bool = False, token_rows_limit: int = TOKEN_ROWS_LIMIT) -> str:
    """The route of one call. num_q_tokens: query's token axis (T); block_table: the kwarg (a
    tensor or None); max_seqlen_q: the longest query of the batch (an int); num_sequences:
    ``len(cu_seq_lens_q) - 1``; gathered: whether ``key``/``value`` already hold every key the
    rows attend to (5.19+ without a block table)."""
    if block_table is not None:
        return "block_table"
    if max_seqlen_q == 1 and num_q_tokens == num_sequences:
        return "gathered" if gathered else "token_table"
    if num_q_tokens <= token_rows_limit:
        return "token_rows"
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
        windows = getattr(cache, "sliding_windows", None)                   # 5.17-5.18
        if windows is not None:
            window = windows.get(module.layer_idx, 1)
        else:                    # 5.19+: what the model passes (Mistral: on every layer)
            window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        soft_cap = kwargs.get("softcap")
        if soft_cap is not None:
            soft_cap = float(soft_cap)
            if not (math.isfinite(soft_cap) and soft_cap >= 0):
                raise ValueError(f"softcap: expected a finite number >= 0, got {soft_cap!r}")
            soft_cap = soft_cap or None
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query_head_dim ** -0.5
        return cls(int(window or 1), soft_cap, kwargs.get("s_aux"), float(scaling))


def per_layer_type(value, variant: LayerVariant):
    """``cu_seq_lens_k``/``max_seqlen_k`` come as a dict by layer type when a model mixes them
    (5.17-5.18; 5.19+'s ``cache.update`` chooses the layer's entry)."""
    return value[variant.layer_type] if isinstance(value, dict) else value


def max_query_length(kwargs):
    """The batch's longest query: ``max_length_q`` (5.19+) or ``max_seqlen_q`` (5.17-5.18)."""
    value = kwargs.get("max_length_q")
    return kwargs.get("max_seqlen_q") if value is None else value


# --------------------------------------------------------------------------- the function
def paged_splitkv_attention(module, query, key, value, attention_mask, scaling=None,
                            dropout: float = 0.0, **kwargs):
    """transformers' attention interface under continuous batching (see the module
    docstring). Returns ``(output, None)``, output ``[T, H, D]`` (decode routes) or
    ``[1, T, H, D]`` (delegated)."""
    from .delegate import delegate

    cache = kwargs.get("cache")            # up to 5.23; 5.24+ keeps it in the model
    if cache is None and "cu_seq_lens_q" not in kwargs:
        raise ValueError("splitkv: called outside continuous batching (no cu_seq_lens_q); it "
                         "serves transformers' continuous batching (generate_batch). Use "
                         "'sdpa' for a plain forward")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"query: expected [1, num_heads, tokens, head_dim], got "
                         f"{tuple(query.shape)}")
    variant = LayerVariant.of(module, cache, query.shape[-1], scaling, kwargs)
    owner = module.config if cache is None else cache
    gathered = cache is None
    if cache is not None and _update_takes_kwargs(cache):
        # 5.19-5.23: the attention calls the update itself, which leaves the call as 5.24's:
        # the layer's kwargs chosen, the keys gathered or the block table's views given
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
        cache, gathered = None, True
    route = decode_route(query.shape[2], kwargs.get("block_table"), max_query_length(kwargs),
                         kwargs["cu_seq_lens_q"].shape[0] - 1, gathered=gathered)
    route_counts[route] += 1
    if route == "delegate":
        return delegate(module, query, key, value, variant, dropout, gathered, owner, kwargs)
    return decode(route, module, query, key, value, variant, cache, owner, kwargs), None


def _update_takes_kwargs(cache) -> bool:
    """Whether ``cache.update`` is 5.19+'s ``update(key, value, layer_idx, kwargs)`` (5.17's
    takes ``read_index`` and ``write_index``)."""
    kind = type(cache)
    known = _UPDATE_TAKES_KWARGS.get(kind)
    if known is None:
        try:
            parameters = inspect.signature(kind.update).parameters
        except (AttributeError, TypeError, ValueError):
            parameters = {}
        known = _UPDATE_TAKES_KWARGS[kind] = "kwargs" in parameters
    return known


class CacheState:
    """What the integration keeps per transformers cache: decode sessions and the last mask."""

    def __init__(self):
        from ..torch_ops import LayerSessions

        self.sessions = LayerSessions()
        self.mask_key, self.mask = None, None

    def close(self) -> None:
        self.sessions.close()


def state_of(owner) -> CacheState:
    """The state of one continuous-batching cache (up to 5.23 it reaches the attention) or,
    where the cache stays inside the model (5.24+), of the model's config."""
    key = id(owner)
    state = _STATES.get(key)
    if state is None:
        state = _STATES[key] = CacheState()
        weakref.finalize(owner, _forget, key)
    return state


def _forget(key: int) -> None:
    state = _STATES.pop(key, None)
    if state is not None:
        state.close()


def decode(route, module, query, key, value, variant: LayerVariant, cache, owner, kwargs):
    """One decode step of a layer through ``torch.ops.splitkv.paged_decode``: the new K/V
    written where the route reads them, then splitkv over the pages. ``cache``: transformers'
    cache where the call must update it the 5.17 way, else None; ``owner``: what keeps the
    sessions.
    Returns [T, H, D]."""
    import torch

    from ..torch_ops import pow2_capacity      # (and registers torch.ops.splitkv.paged_decode)

    layer = module.layer_idx
    rows, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    cu_k = per_layer_type(kwargs["cu_seq_lens_k"], variant)[:rows + 1]
    seq_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32) if route == "block_table" else None
    window_left = variant.window_left
    if route == "block_table" and "k_cache" in kwargs:                     # 5.19+
        table, k_pages, v_pages = kwargs["block_table"], kwargs["k_cache"], kwargs["v_cache"]
        page_size = k_pages.shape[1]
        _write_rows(k_pages, v_pages, key, value, seq_lens, table)
        group = table.data_ptr()          # the allocator's rows of a static table
    elif route == "block_table":                                           # 5.17-5.18
        group, k_pool, v_pool = _pools(cache, layer)
        table, page_size = kwargs["block_table"][group], cache.block_size
        _store(k_pool, v_pool, next_slots(seq_lens, table, page_size, cache.write_trash_index),
               key, value)
        pages = (-1, page_size, kv_heads, head_dim)
        k_pages, v_pages = k_pool.view(pages), v_pool.view(pages)
    elif route == "token_table":                                           # 5.17-5.18
        group, k_pool, v_pool = _pools(cache, layer)
        slots, read = kwargs["write_index"][group], kwargs["read_index"][group]
        _store(k_pool, v_pool, slots, key, value)
        # the read list holds only the window's tokens
        page_size, window_left, width = 1, -1, cache.num_pages + cache.max_batch_tokens
        tables = [cu_k.to(torch.int32), token_slots(read, slots, cu_k, cache.sentinel_index)]
        k_pages, v_pages = k_pool.view(-1, 1, kv_heads, head_dim), \
            v_pool.view(-1, 1, kv_heads, head_dim)
    else:                                            # over the gathered keys: one-token pages
        keys, values = gathered_keys(module, key, value, cache, kwargs)    # [K, H_kv, D]
        page_size, group = 1, variant.layer_type     # one allocator per attention type
        k_pages, v_pages = keys.unsqueeze(1), values.unsqueeze(1)
        if route == "token_rows":
            max_k = per_layer_type(kwargs.get("max_length_k", kwargs.get("max_seqlen_k")),
                                   variant)
            width = pow2_capacity(int(max_k) if isinstance(max_k, int) and max_k > 0
                                  else keys.shape[0])
            cu_q = kwargs["cu_seq_lens_q"]
            cu_k = per_layer_type(kwargs["cu_seq_lens_k"], variant)[:cu_q.shape[0]]
            tables = token_row_tables(cu_q, cu_k, rows, width)
        else:                                                              # gathered, 5.19+
            width = pow2_capacity(keys.shape[0])
            indices = torch.arange(keys.shape[0], dtype=torch.int32, device=keys.device)
            tables = [cu_k.to(torch.int32), indices]
    if route == "block_table":
        tables, width = [seq_lens, table], table.shape[1]
    capacity = pow2_capacity(rows)
    layout = "block_table" if route in ("block_table", "token_rows") else "indptr"
    session_key = (route, capacity, group, width, page_size, query.dtype, variant.scaling,
                   variant.soft_cap, window_left)
    handle, plans = state_of(owner).sessions.session(session_key, layer, lambda: dict(
        num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        dtype=query.dtype, layout=layout, capacity=capacity, width=width,
        sm_scale=variant.scaling, logits_soft_cap=variant.soft_cap, window_left=window_left))
    return torch.ops.splitkv.paged_decode(query[0].transpose(0, 1), k_pages, v_pages, tables,
                                          variant.sinks, handle, plans)


def _write_rows(k_pages, v_pages, key, value, seq_lens, table) -> None:
    """Write each row's new K/V at its last position (5.19+'s block-table path leaves this to
    the attention). Padding rows (length 0) rewrite row 0's slot with row 0's values, so the
    write is one fixed-shape ``index_copy_`` (capturable) that changes nothing for them."""
    import torch

    page_size, kv_heads, head_dim = k_pages.shape[1:]
    slots = next_slots(seq_lens, table, page_size, trash=-1)
    valid = slots >= 0
    slots = torch.where(valid, slots, slots[:1])
    keep = valid.view(1, 1, -1, 1)                   # key, value: [1, H_kv, rows, D]
    _store(k_pages.view(-1, kv_heads, head_dim), v_pages.view(-1, kv_heads, head_dim), slots,
           torch.where(keep, key, key[:, :, :1]), torch.where(keep, value, value[:, :, :1]))


def _pools(cache, layer: int):
    """(the layer's cache group, its K pool, its V pool) in a 5.17-5.18 cache."""
    group, index_in_group = cache.layer_index_to_group_indices[layer]
    return group, cache.key_cache[index_in_group], cache.value_cache[index_in_group]


def _store(k_tokens, v_tokens, slots, key, value) -> None:
    """The step's new K/V (``[1, H_kv, rows, D]``) into token-major pools at ``slots``."""
    k_tokens.index_copy_(0, slots, key[0].transpose(0, 1))
    v_tokens.index_copy_(0, slots, value[0].transpose(0, 1))


def next_slots(seq_lens, table, page_size: int, trash: int):
    """The cache slot of each row's new token (its last position, counted in ``seq_lens``);
    ``trash`` for padding rows (length 0). int64 [rows]."""
    import torch

    pos = seq_lens.to(torch.int64) - 1
    safe = pos.clamp(min=0)
    page = table.gather(1, (safe // page_size).unsqueeze(1)).squeeze(1).to(torch.int64)
    slot = page * page_size + safe % page_size
    return torch.where((pos >= 0) & (page >= 0), slot, torch.full_like(slot, trash))


def token_slots(read, write, cu_k, sentinel: int):
    """``read_index`` with each new token's placeholder (``sentinel``, sliding-window groups)
    replaced by the slot it was written to: the slots splitkv reads, int32 [len(read)]."""
    import torch

    positions = torch.arange(read.shape[0], device=read.device, dtype=cu_k.dtype)
    request = torch.searchsorted(cu_k[1:].contiguous(), positions, right=True)
    request = request.clamp(max=write.shape[0] - 1)
    return torch.where(read == sentinel, write[request], read).to(torch.int32)


def gathered_keys(module, key, value, cache, kwargs):
    """Every key and value the batch's rows attend to, ``[K, H_kv, D]`` each, request by request
    in ``cu_seq_lens_k`` order: what 5.19+'s update gave, or (5.17-5.18) what ``cache.update``
    returns after writing the new tokens."""
    if cache is None:
        return key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    return cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])


def token_row_tables(cu_seq_lens_q, cu_seq_lens_k, rows: int, width: int):
    """``[seq_lens int32 [rows], block_table int32 [rows, width]]`` with one row per query
    token, over one-token pages of the gathered keys: token i of request r sees r's keys up to
    its own position (``k_len - q_len + i + 1`` of them, from ``cu_seq_lens_k[r]``); padding
    tokens see none. Device ops of fixed shapes (capturable)."""
    import torch

    cu_q, cu_k = cu_seq_lens_q.to(torch.int64), cu_seq_lens_k.to(torch.int64)
    num_seq = cu_q.shape[0] - 1
    token = torch.arange(rows, device=cu_q.device)
    request = torch.searchsorted(cu_q[1:].contiguous(), token, right=True)
    r = request.clamp(max=max(num_seq - 1, 0))
    seen = (cu_k[r + 1] - cu_k[r]) - (cu_q[r + 1] - cu_q[r]) + (token - cu_q[r]) + 1
    seq_lens = torch.where(request < num_seq, seen, torch.zeros_like(seen)).to(torch.int32)
    columns = torch.arange(width, device=cu_q.device)
    table = (cu_k[r].unsqueeze(1) + columns.unsqueeze(0)).to(torch.int32)
    return [seq_lens, table]
