"""Making transformers' continuous batching accept splitkv, on the releases that name attention
implementations differently.

- transformers 5.17-5.18 run continuous batching through ``"paged|<name>"`` implementations:
  the manager switches a model set to ``"splitkv"`` to ``"paged|splitkv"`` (or to flash
  attention, where it is installed).
- transformers 5.19 and later dropped the prefix (from 5.23 ``"paged|x"`` means ``"x"``, with a
  FutureWarning) and accept only ``"sdpa"``, ``"paged|eager"`` and flash names for continuous
  batching (``ContinuousBatchingManager.switch_to_cb_friendly_attn``).

Both releases give the decode fast path (a block table for decode-only batches, and one CUDA
graph per padded batch size) only to flash names
(``continuous_batching.initialization.ensure_decode_fast_path_is_available``).

:func:`register` therefore registers ``"splitkv"`` and ``"paged|splitkv"`` in
``AttentionInterface`` and widens those two private checks for splitkv's names only; every other
implementation goes through transformers' checks unchanged. A check that is missing or has
changed its signature is left alone, with one warning saying what is lost.
"""

from __future__ import annotations

import inspect
import warnings

NAME = "splitkv"
PAGED_NAME = "paged|" + NAME

#: every key registered in AttentionInterface (a model's ``_attn_implementation`` is one of these)
_REGISTERED: set[str] = set()
_WARNED: set[str] = set()


def register(name: str = NAME, *, decode_fast_path: bool = True) -> str:
    """Register ``name`` (and ``"paged|" + name``) as transformers attention implementations
    that continuous batching accepts; returns the name to pass to ``set_attn_implementation``
    or ``from_pretrained(attn_implementation=...)``.

    ``decode_fast_path``: let transformers hand splitkv its block table for decode-only batches
    (and capture one CUDA graph per padded batch size); False leaves that check untouched.
    """
    if not isinstance(name, str) or not name or "|" in name or name.startswith("paged"):
        raise ValueError(f"name: expected a plain name such as 'splitkv' (no 'paged|' prefix: "
                         f"it is added where a release wants it), got {name!r}")
    from transformers import AttentionInterface

    from .attention import paged_splitkv_attention

    for key in (name, "paged|" + name):
        AttentionInterface.register(key, paged_splitkv_attention)
        _REGISTERED.add(key)
    _accept_in_continuous_batching()
    if decode_fast_path:
        _open_decode_fast_path()
    return name


def registered_names() -> frozenset:
    return frozenset(_REGISTERED)


def is_splitkv(config) -> bool:
    return getattr(config, "_attn_implementation", None) in _REGISTERED


def uses_paged_prefix() -> bool:
    """Whether this transformers runs continuous batching through ``"paged|"`` names (5.17-5.18:
    it still ships ``"paged|sdpa"``)."""
    from transformers import AttentionInterface

    return "paged|sdpa" in AttentionInterface._global_mapping


def _warn_once(what: str, message: str) -> None:
    # A warning, not a notice of the "splitkv" logger: it is said to the programmer who called
    # register(), at that call, about the transformers they installed (pin another release, or
    # turn it into an error in their tests with -W error::RuntimeWarning).
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _signature_starts(function, names: tuple[str, ...]) -> bool:
    try:
        params = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(params[:len(names)]) == names


# --------------------------------------------------------------------------- the manager's gate
def _accept_in_continuous_batching() -> None:
    """``switch_to_cb_friendly_attn`` keeps a splitkv model on splitkv (5.19+ would refuse the
    name; 5.17-5.18 would switch it to flash attention when flash is installed)."""
    try:
        from transformers.generation.continuous_batching.continuous_api import \
            ContinuousBatchingManager
    except ImportError:
        ContinuousBatchingManager = None
    switch = getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    if switch is None or not _signature_starts(switch, ("self", "model")):
        _warn_once("switch", "splitkv: this transformers has no ContinuousBatchingManager."
                   "switch_to_cb_friendly_attn(self, model, ...) to widen; continuous batching "
                   "may refuse or replace the 'splitkv' attention implementation")
        return
    if getattr(switch, "splitkv_names", None) is not None:
        return

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if not is_splitkv(model.config):
            return switch(self, model, *args, **kwargs)
        current = model.config._attn_implementation
        if uses_paged_prefix() and not current.startswith("paged|"):
            model.set_attn_implementation("paged|" + current)
            self._original_attn_impl = current
        return None

    switch_to_cb_friendly_attn.splitkv_names = _REGISTERED
    switch_to_cb_friendly_attn.__wrapped__ = switch
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


# --------------------------------------------------------------------------- the decode fast path
def _open_decode_fast_path() -> None:
    """Keep transformers' ``max_blocks_per_request`` (its block tables) for splitkv's names when
    every attention type of the model supports block tables (5.19+ asks its cache allocators;
    5.17-5.18 drop them for sliding-window groups in the cache itself)."""
    try:
        from transformers.generation.continuous_batching import initialization
    except ImportError:
        initialization = None
    check = getattr(initialization, "ensure_decode_fast_path_is_available", None)
    if check is None or not _signature_starts(check, ("config", "cb_config", "user_requested")):
        _warn_once("fast_path", "splitkv: this transformers has no continuous_batching."
                   "initialization.ensure_decode_fast_path_is_available(config, cb_config, "
                   "user_requested) to widen; decode batches reach splitkv without a block "
                   "table (the token-table route), and padded batches under CUDA graphs are "
                   "delegated")
        return
    if getattr(check, "splitkv_names", None) is not None:
        return

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested, *args, **kwargs):
        if not is_splitkv(config):
            return check(config, cb_config, user_requested, *args, **kwargs)
        if cb_config.max_blocks_per_request and not _all_types_support_block_tables(config):
            cb_config.max_blocks_per_request = 0
        return None

    ensure_decode_fast_path_is_available.splitkv_names = _REGISTERED
    ensure_decode_fast_path_is_available.__wrapped__ = check
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


def _all_types_support_block_tables(config) -> bool:
    from transformers.generation.continuous_batching import initialization

    allocators = getattr(initialization, "ATTN_TYPE_TO_ALLOCATOR", None)
    group = getattr(initialization, "group_layers_by_attn_type", None)
    if allocators is None or group is None:       # 5.17-5.18: the cache decides per group
        return True
    return all(getattr(allocators[kind], "supports_block_table", False) for kind in group(config))
