"""KV cache layouts engines use, read as splitkv's NHD K and V (``[num_pages, page_size,
num_kv_heads, head_dim]`` each), zero-copy:

- K and V as two arrays, or as a ``(k_cache, v_cache)`` pair;
- one combined array, FlashInfer's ``[num_pages, 2, page_size, heads, dim]`` or vLLM's
  ``[2, num_pages, page_size, heads, dim]``: told apart by which leading axis has size 2 (when
  both do, the call must pass K and V apart: nothing is guessed);
- ``kv_layout="HND"`` (FlashInfer's name): pages of ``[heads, page_size, dim]``, read through a
  transposed view (the GPU kernels take the view's head stride).
"""

from __future__ import annotations

KV_LAYOUTS = ("NHD", "HND")


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def combined_axis(name: str, shape) -> int:
    """Which axis of a combined K/V array's shape holds K and V (0: vLLM, 1: FlashInfer)."""
    if len(shape) != 5:
        raise ValueError(f"{name}: a combined K/V cache is 5-d ([num_pages, 2, page_size, heads, "
                         f"dim] or [2, num_pages, ...]); got shape {list(shape)}")
    first, second = shape[0] == 2, shape[1] == 2
    if first and second:
        raise ValueError(f"{name}: shape {list(shape)} could be FlashInfer's [num_pages, 2, ...] "
                         "or vLLM's [2, num_pages, ...]; pass k_cache and v_cache apart")
    if not (first or second):
        raise ValueError(f"{name}: a combined K/V cache has K and V on axis 0 (vLLM) or 1 "
                         f"(FlashInfer), of size 2; got shape {list(shape)}")
    return 0 if first else 1


def split_kv(k_cache, v_cache):
    """(k, v) from two arrays, a pair, or one combined array (views, any array package that
    slices like NumPy)."""
    if v_cache is not None:
        return k_cache, v_cache
    if isinstance(k_cache, (tuple, list)):
        if len(k_cache) != 2:
            raise ValueError(f"k_cache: a (k_cache, v_cache) pair has 2 arrays, got "
                             f"{len(k_cache)}")
        return k_cache[0], k_cache[1]
    shape = getattr(k_cache, "shape", None)
    if shape is None:
        raise TypeError(f"k_cache: expected an array, a (k, v) pair or a combined K/V array, got "
                        f"{type(k_cache).__name__}")
    if combined_axis("k_cache", tuple(shape)) == 0:
        return k_cache[0], k_cache[1]
    return k_cache[:, 0], k_cache[:, 1]


def as_nhd(arr, kv_layout: str):
    """An HND cache seen as NHD (a transposed view); NHD unchanged."""
    if check_kv_layout(kv_layout) == "NHD" or arr is None:
        return arr
    if len(getattr(arr, "shape", ())) != 4:
        return arr             # the shape checks that follow name the argument
    return arr.transpose(0, 2, 1, 3)
